"""Every field of an untrusted spec has the type and bounds the replay needs: checked before anything runs.

Every field the replay reads has the type it must have; tensor layouts have non-negative sizes and
strides, a known element size and no overflowing extent; each argument's value fits its schema
type (a string where the schema says ``str``, integers where it says ``int[]`` ...); recorded
integer data is base64 of a bounded size; host gaps are finite and bounded (a replay cannot be made
to spin). The first field that is not is a :class:`~workloads.trace_bundle.TraceError` naming the
file, the op and the field.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from pathlib import Path
from typing import Any

import torch

from workloads.trace_bundle import (
    EXACT_VALUE_BUDGET,
    EXACT_VALUE_ELEMENTS,
    MAX_VALUE_ENTRIES,
    ZERO_SLICE_BUDGET,
    ZERO_SLICE_INDICES,
    TraceError,
)
from workloads.trace_replay.ops import ET_DTYPES, LAYOUTS, MEMORY_FORMATS, SCALAR_TYPES, at, list_types

_OP_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*::[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?")

MAX_INT = 2**63 - 1
MAX_ELEMENTS = 2**48  # no tensor view spans more elements than this (~281 T)
MAX_GAP_US = 10e6  # one host gap: 10 s
MAX_GAP_SAMPLES = 1000  # host-gap measurements a step's estimate rests on
MAX_STEP_HOST_US = 60e6  # one step's host time in all: 60 s
MAX_REPEAT = 10_000
MAX_STRING = 4096
MATRIX_KINDS = {"symmetric", "positive_definite"}
FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz", "complex64", "complex128", "complex32"}
MAX_TENSOR_DATA_CHARS = 4 * (64 * 2**20) // 3  # base64 of 64 MiB
ITEMSIZES = {1, 2, 4, 8, 16}


class SpecFields:
    """Walks a spec and raises a TraceError at the first field that is not what the replay needs."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str) -> TraceError:
        return TraceError(f"{self.path}: {where}: {problem}; regenerate it with `cobench trace generate BUNDLE`")

    def need(self, ok: bool, where: str, problem: str) -> None:
        if not ok:
            raise self.fail(where, problem)

    def dict_(self, value: Any, where: str) -> dict[str, Any]:
        self.need(isinstance(value, dict), where, f"expected an object, found {type(value).__name__}")
        return value

    def list_(self, value: Any, where: str) -> list[Any]:
        self.need(isinstance(value, list), where, f"expected a list, found {type(value).__name__}")
        return value

    def int_(self, value: Any, where: str, low: int = -MAX_INT - 1, high: int = MAX_INT) -> int:
        self.need(type(value) is int, where, f"expected an integer, found {_show(value)}")
        self.need(low <= value <= high, where, f"{value} is outside [{low}, {high}]")
        return value

    def number(self, value: Any, where: str, low: float = 0.0, high: float = math.inf) -> float:
        self.need(type(value) in (int, float), where, f"expected a number, found {_show(value)}")
        self.need(math.isfinite(value) and low <= value <= high, where, f"{value} is outside [{low}, {high}]")
        return float(value)

    def str_(self, value: Any, where: str) -> str:
        self.need(type(value) is str, where, f"expected a string, found {_show(value)}")
        self.need(len(value) <= MAX_STRING, where, f"a string of {len(value)} characters (at most {MAX_STRING})")
        return value

    # -- the spec --------------------------------------------------------------------------------------
    def spec(self, spec: dict[str, Any]) -> None:
        source = self.dict_(spec.get("source"), "source")
        self.dict_(source.get("platform", {}), "source.platform")
        for key in ("workload", "run_id"):
            self.str_(source.get(key, ""), f"source.{key}")
        self.int_(source.get("world_size", 1), "source.world_size", 1)
        ranks = spec["ranks"]
        for key in ("step_times_ms", "traced_step_times_ms"):
            per_rank = self.list_(source.get(key, []), f"source.{key}")
            for r, times in enumerate(per_rank):
                for i, t in enumerate(self.list_(times, f"source.{key}[{r}]")):
                    self.number(t, f"source.{key}[{r}][{i}]")
        self.need(len(source.get("step_times_ms", [])) >= 1, "source.step_times_ms", "no reference step times")
        for i, b in enumerate(self.list_(source.get("peak_memory_bytes", []), "source.peak_memory_bytes")):
            self.int_(b, f"source.peak_memory_bytes[{i}]", 0)
        options = self.dict_(spec.get("options"), "options")
        self.int_(options.get("repeat", 1), "options.repeat", 1, MAX_REPEAT)
        self.need(type(spec.get("full_step", False)) is bool, "full_step", "expected true or false")
        for r, rank in enumerate(ranks):
            self.rank(self.dict_(rank, f"ranks[{r}]"), f"ranks[{r}]")

    def rank(self, rank: dict[str, Any], where: str) -> None:
        steps = self.list_(rank.get("steps", []), f"{where}.steps")
        host_us: dict[int, float] = {}
        for i, step in enumerate(steps):
            loc = f"{where}.steps[{i}]"
            self.dict_(step, loc)
            index = self.int_(step.get("index"), f"{loc}.index", 0)
            for key in ("tail_gap_us", "host_gap_us", "ops_dur_us"):
                self.number(step.get(key, 0.0), f"{loc}.{key}", 0.0, MAX_STEP_HOST_US if key != "ops_dur_us" else 1e12)
            samples = self.list_(step.get("host_gap_samples_us", []), f"{loc}.host_gap_samples_us")
            self.need(len(samples) <= MAX_GAP_SAMPLES, f"{loc}.host_gap_samples_us",
                      f"{len(samples)} samples (at most {MAX_GAP_SAMPLES})")
            for j, sample in enumerate(samples[:MAX_GAP_SAMPLES]):
                self.number(sample, f"{loc}.host_gap_samples_us[{j}]", 0.0, MAX_STEP_HOST_US)
            self.int_(step.get("kineto_ops", 0), f"{loc}.kineto_ops", 0)
            self.number(step.get("program_kineto_ops", 0.0), f"{loc}.program_kineto_ops", 0.0, 1e9)
            self.number(step.get("program_op_us", 0.0), f"{loc}.program_op_us", 0.0, 1e12)
            self.number(step.get("host_spin_ns", 0.0), f"{loc}.host_spin_ns", 0.0, 1e6)
            self.number(step.get("host_speed_elasticity", 1.0), f"{loc}.host_speed_elasticity", 0.0, 2.0)
            host_us[index] = step.get("tail_gap_us", 0.0)
        values = self.list_(rank.get("external_values", []), f"{where}.external_values")
        self.need(len(values) <= MAX_VALUE_ENTRIES, f"{where}.external_values",
                  f"{len(values)} entries (at most {MAX_VALUE_ENTRIES})")
        exact = indices = 0  # elements recorded whole, indices of wholly zero slices
        for i, entry in enumerate(values):
            whole, zero = self.value_stats(self.dict_(entry, f"{where}.external_values[{i}]"),
                                           f"{where}.external_values[{i}]")
            exact, indices = exact + whole, indices + zero
        self.need(exact <= EXACT_VALUE_BUDGET, f"{where}.external_values",
                  f"{exact} elements recorded whole (at most {EXACT_VALUE_BUDGET})")
        self.need(indices <= ZERO_SLICE_BUDGET, f"{where}.external_values",
                  f"{indices} indices of wholly zero slices (at most {ZERO_SLICE_BUDGET})")
        for i, op in enumerate(self.list_(rank["ops"], f"{where}.ops")):
            loc = f"{where}.ops[{i}]"
            self.op(self.dict_(op, loc), loc)
            step = op["step"]
            host_us[step] = host_us.get(step, 0.0) + (op.get("gap_us") or 0.0)
            self.need(host_us[step] <= MAX_STEP_HOST_US, loc,
                      f"step {step}'s host gaps add up to over {MAX_STEP_HOST_US / 1e6:.0f} s")

    def value_stats(self, entry: dict[str, Any], where: str) -> tuple[int, int]:
        """Checks one value profile; returns how many elements it records whole (``data``) and how many indices
        of wholly zero slices (``zero_slices``)."""
        shape = self.list_(entry.get("shape"), f"{where}.shape")
        self.need(len(shape) <= 64, f"{where}.shape", f"{len(shape)} dimensions")
        for d in shape:
            self.int_(d, f"{where}.shape", 0, MAX_ELEMENTS)
        self.need(type(entry.get("dtype")) is str and entry["dtype"] in FLOAT_DTYPES, f"{where}.dtype",
                  f"{_show(entry.get('dtype'))} is not a floating dtype")
        self.summary(entry, where)
        for key in ("zeros", "zero_rows"):  # zero_rows: the share of wholly zero rows, as older bundles record it
            if key in entry:
                self.number(entry[key], f"{where}.{key}", 0.0, 1.0)
        self.need(entry.get("zero_rows", 0.0) <= entry.get("zeros", 0.0), where,
                  f"zero_rows {entry.get('zero_rows')} exceeds zeros {entry.get('zeros')}")
        indices = self.zero_slices(entry, shape, where)
        if "nonzero" in entry:
            self.summary(self.dict_(entry["nonzero"], f"{where}.nonzero"), f"{where}.nonzero")
        if "op" in entry:  # the reader of a 0-dim tensor, recorded at each read
            self.str_(entry["op"], f"{where}.op")
            self.need(not shape, f"{where}.op", f"a reader recorded for a tensor of shape {shape}, not 0-dim")
        if "reader" in entry:  # the first reader of any other
            self.str_(entry["reader"], f"{where}.reader")
        if "matrix" in entry:  # a square matrix, or a batch of them, of a kind its values must keep
            self.need(entry["matrix"] in MATRIX_KINDS, f"{where}.matrix",
                      f"{_show(entry['matrix'])} is not one of {sorted(MATRIX_KINDS)}")
            self.need(len(shape) >= 2 and shape[-1] == shape[-2], f"{where}.matrix",
                      f"a matrix kind recorded for shape {shape}, not square")
        if "data" not in entry:
            return 0, indices
        numel, loc = math.prod(shape), f"{where}.data"
        self.need(numel <= EXACT_VALUE_ELEMENTS, loc, f"{numel} elements recorded whole (at most "
                  f"{EXACT_VALUE_ELEMENTS} a tensor)")
        raw = self.base64_(entry["data"], loc)
        itemsize = torch.empty(0, dtype=getattr(torch, entry["dtype"])).element_size()
        self.need(len(raw) == numel * itemsize, loc, f"{len(raw)} bytes where {numel} {entry['dtype']} elements "
                  f"take {numel * itemsize}")
        return numel, indices

    def zero_slices(self, entry: dict[str, Any], shape: list[int], where: str) -> int:
        """A value profile's wholly zero slices: per dimension of its shape, their indices (distinct, in
        range, at most :data:`~workloads.trace_bundle.ZERO_SLICE_INDICES`) or their share (no more than its
        zeros); returns how many indices it lists."""
        listed = 0
        for key in ("zero_slices", "zero_slice_shares"):
            for dim, value in self.dict_(entry.get(key, {}), f"{where}.{key}").items():
                loc = f"{where}.{key}.{dim}"
                self.need(type(dim) is str and dim.isdigit() and int(dim) < len(shape), loc,
                          f"not a dimension of shape {shape}")
                if key == "zero_slice_shares":
                    self.number(value, loc, 0.0, entry.get("zeros", 0.0))
                    continue
                index = self.list_(value, loc)
                self.need(len(index) <= ZERO_SLICE_INDICES, loc, f"{len(index)} indices (at most "
                          f"{ZERO_SLICE_INDICES})")
                for i in index:
                    self.int_(i, loc, 0, shape[int(dim)] - 1)
                self.need(len(set(index)) == len(index), loc, "indices repeat")
                listed += len(index)
        return listed

    def summary(self, figures: dict[str, Any], where: str) -> None:
        """A value profile's mean, std, min and max: numbers, the mean inside the range."""
        for key in ("mean", "min", "max"):
            self.number(figures.get(key), f"{where}.{key}", -math.inf, math.inf)
        self.number(figures.get("std"), f"{where}.std")
        self.need(figures["min"] <= figures["mean"] <= figures["max"], where,
                  f"mean {figures['mean']} is outside [min {figures['min']}, max {figures['max']}]")

    def base64_(self, data: Any, where: str) -> bytes:
        """Recorded raw bytes: base64 text, decoded."""
        self.need(type(data) is str, where, "expected base64 text")
        try:
            return base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError):
            raise self.fail(where, "not base64") from None

    def op(self, op: dict[str, Any], where: str) -> None:
        name = self.str_(op.get("name"), f"{where}.name")
        self.need(bool(_OP_NAME.fullmatch(name)), f"{where}.name", f"{name[:80]!r} is not an operator name")
        schema = self.str_(op.get("schema"), f"{where}.schema")
        self.need(schema.split("(", 1)[0].split(".", 1)[0] == name.split(".", 1)[0], f"{where}.schema",
                  f"the schema names {schema.split('(', 1)[0][:80]!r}, the op {name!r}")
        self.int_(op.get("step"), f"{where}.step", 0)
        self.int_(op.get("id", 0), f"{where}.id", 0)
        self.str_(op.get("category"), f"{where}.category")
        for key in ("dur_us", "gap_us"):
            if op.get(key) is not None:
                self.number(op[key], f"{where}.{key}", 0.0, MAX_GAP_US if key == "gap_us" else 1e12)
        self.need(type(op.get("grad", False)) is bool, f"{where}.grad", f"{_show(op.get('grad'))} is not true or false")
        for s, scope in enumerate(self.list_(op.get("scopes", []), f"{where}.scopes")):
            self.str_(scope, f"{where}.scopes[{s}]")
        for d, dep in enumerate(self.list_(op.get("deps", []), f"{where}.deps")):
            self.int_(dep, f"{where}.deps[{d}]")
        self.int_(op.get("held_bytes", 0), f"{where}.held_bytes", 0)  # made after it (a composite kept whole)
        self.int_(op.get("transient_bytes", 0), f"{where}.transient_bytes", 0)  # and its peak inside above that
        if op.get("waited_after_ops") is not None:  # a collective waited for that many ops on
            self.int_(op["waited_after_ops"], f"{where}.waited_after_ops", 1)
        for key in ("allocated", "released", "born"):  # storage ids (lifetimes)
            for d, storage in enumerate(self.list_(op.get(key, []), f"{where}.{key}")):
                self.int_(storage, f"{where}.{key}[{d}]")
        for key, rng in self.dict_(op.get("tensor_range", {}), f"{where}.tensor_range").items():
            loc = f"{where}.tensor_range[{key!r}]"
            self.need(key.isdigit() and isinstance(rng, list) and len(rng) == 2, loc, "expected [low, high]")
            self.need(self.int_(rng[0], loc) <= self.int_(rng[1], loc), loc, f"low {rng[0]} > high {rng[1]}")
        for key, data in self.dict_(op.get("tensor_data", {}), f"{where}.tensor_data").items():
            loc = f"{where}.tensor_data[{key!r}]"
            self.need(key.isdigit() and type(data) is str, loc, "expected base64 text")
            self.need(len(data) <= MAX_TENSOR_DATA_CHARS, loc, f"{len(data)} characters of data (at most "
                      f"{MAX_TENSOR_DATA_CHARS})")
            self.base64_(data, loc)
        arg_types: list[str] | None = None
        if not name.startswith("c10d::"):
            try:
                arg_types = [str(a.type) for a in torch._C.parse_schema(schema).arguments]
            except RuntimeError as err:
                raise self.fail(f"{where}.schema", f"not an operator schema ({str(err).splitlines()[0]})") from None
        for side in ("inputs", "outputs"):
            self.values(self.dict_(op.get(side), f"{where}.{side}"), f"{where}.{side}",
                        arg_types if side == "inputs" else None)

    def values(self, io: dict[str, Any], where: str, arg_types: list[str] | None) -> None:
        columns = [self.list_(io.get(k, []), f"{where}.{k}") for k in ("values", "types", "shapes", "strides")]
        values, types, shapes, strides = columns
        self.need(len(types) == len(values), where, f"{len(values)} values but {len(types)} types")
        for i, (value, et_type) in enumerate(zip(values, types, strict=True)):
            loc = f"{where}.values[{i}]"
            self.str_(et_type, f"{where}.types[{i}]")
            shape, stride = at(shapes, i), at(strides, i)
            if et_type.startswith("GenericList["):
                self.list_(value, loc)
                items = list_types(et_type)
                for j, item in enumerate(value):
                    item_type = items[j] if j < len(items) else ""
                    self.value(item, item_type, at(shape, j), at(stride, j), f"{loc}[{j}]")
            else:
                self.value(value, et_type, shape, stride, loc)
            if arg_types is not None and i < len(arg_types):
                self.fits_schema(value, et_type, arg_types[i], loc)

    def value(self, value: Any, et_type: str, shape: Any, stride: Any, where: str, depth: int = 0) -> None:
        if "nullptr" in et_type:
            return  # an undefined tensor: the replay passes None
        if et_type.startswith("Tensor(") and isinstance(value, list):
            self.need(len(value) == 6 and type(value[5]) is str, where,
                      f"a tensor reference is [tensor id, storage id, offset, elements, element size, device], "
                      f"found {_show(value)}")
            self.tensor(value, et_type, shape, stride, where)
        elif isinstance(value, list):
            self.need(depth < 4, where, "lists nested deeper than 4")
            for j, item in enumerate(value):
                self.value(item, "", None, None, f"{where}[{j}]", depth + 1)
        else:
            self.scalar(value, where)

    def scalar(self, value: Any, where: str) -> None:
        if type(value) is int:
            self.int_(value, where)
        elif type(value) is str:
            self.str_(value, where)
        else:  # floats (NaN and ±inf are legitimate scalars), booleans, null
            self.need(value is None or type(value) in (bool, float), where, f"unexpected value {_show(value)}")

    def tensor(self, ref: list, et_type: str, shape: Any, stride: Any, where: str) -> None:
        self.int_(ref[0], f"{where} (tensor id)")
        self.int_(ref[1], f"{where} (storage id)")
        offset = self.int_(ref[2], f"{where} (storage offset)", 0, MAX_ELEMENTS)
        self.int_(ref[3], f"{where} (element count)", 0)
        if ref[4] == 0:  # no storage of its own: a sparse tensor the step makes, as the ET writes one
            self.need(ref[1:] == [0, 0, 0, 0, ""], where, f"a tensor with no storage of its own is "
                      f"[tensor id, 0, 0, 0, 0, ''], found {_show(ref)}")
            for s in self.list_(shape if shape is not None else [], f"{where} (shape)"):
                self.int_(s, f"{where} (shape)", 0, MAX_ELEMENTS)
            return
        itemsize = self.int_(ref[4], f"{where} (element size)", 1, 16)
        self.need(itemsize in ITEMSIZES, where, f"element size {itemsize} is not 1, 2, 4, 8 or 16")
        self.str_(ref[5], f"{where} (device)")
        dtype = ET_DTYPES.get(et_type[len("Tensor("):-1])
        if dtype is not None:
            self.need(dtype.itemsize == itemsize, where, f"{et_type} has elements of {dtype.itemsize} bytes, "
                      f"the reference says {itemsize}")
        sizes = self.list_(shape if shape is not None else [], f"{where} (shape)")
        for s in sizes:
            self.int_(s, f"{where} (shape)", 0, MAX_ELEMENTS)
        if isinstance(stride, list) and len(stride) == len(sizes):
            for s in stride:
                self.int_(s, f"{where} (strides)", 0, MAX_ELEMENTS)
            steps = stride
        else:
            steps = [0] * len(sizes)
        numel, extent = 1, 1
        for size, step in zip(sizes, steps, strict=True):
            numel *= size
            extent += (size - 1) * step if size else 0
            self.need(numel <= MAX_ELEMENTS and extent <= MAX_ELEMENTS, where,
                      f"shape {sizes} spans more than {MAX_ELEMENTS} elements")
        self.need(offset + extent <= MAX_ELEMENTS, where, "the view ends past any storage this replay can make")

    def fits_schema(self, value: Any, et_type: str, arg_type: str, where: str) -> None:
        """The value the trace recorded is of the kind the operator's schema takes."""
        if value is None or value == "<None>" or et_type == "None":
            return
        base = arg_type[len("Optional["):-1] if arg_type.startswith("Optional[") else arg_type
        expected = _schema_kind(base)
        if expected == "tensor":
            ok = et_type.startswith(("Tensor(", "GenericList[")) or et_type == "None"
        elif expected == "list":
            ok = isinstance(value, list) or type(value) is int  # the ET writes int[1] as an int
        elif expected == "int":
            ok = type(value) is int or (type(value) is bool and et_type == "Bool")
        elif expected == "float":
            ok = type(value) in (int, float) or (type(value) is str and _is_float(value))
        elif expected == "bool":
            ok = type(value) is bool or value in (0, 1)
        elif expected == "str":
            ok = type(value) is str
        elif expected == "scalar":
            ok = type(value) in (int, float, bool) or (type(value) is str and _is_float(value)) \
                or (et_type.startswith("Complex") and value == f"<{et_type}>")  # a complex one: its type alone
        else:
            ok = True  # Device, Generator, Layout ...: converted or dropped by the replay
        self.need(ok, where, f"the schema takes '{arg_type}', the spec gives {_show(value)} ({et_type})")
        if base in ("ScalarType", "Layout", "MemoryFormat") and type(value) is int:
            table = {"ScalarType": SCALAR_TYPES, "Layout": LAYOUTS, "MemoryFormat": MEMORY_FORMATS}[base]
            self.need(value in table, where, f"{value} is not a {base} this replay knows")


def _schema_kind(arg_type: str) -> str:
    if "Tensor" in arg_type:
        return "tensor"
    if arg_type.startswith("List[") or arg_type.endswith("[]"):
        return "list"
    return {"int": "int", "SymInt": "int", "float": "float", "bool": "bool", "str": "str", "Scalar": "scalar",
            "ScalarType": "int", "Layout": "int", "MemoryFormat": "int"}.get(arg_type, "other")


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'…' if len(text) > 60 else ''}"
