"""Export a bundle's execution trace as Chakra protobuf, through the ``mlc-chakra`` package.

``mlc-chakra`` is an optional extra (``pip install -e .[chakra]``: it pulls HolisticTraceAnalysis
and Jupyter). Each rank's ``et.json`` becomes ``<out>/rank<i>.et`` — the file naming Chakra's
simulators (ASTRA-sim) expect — after the same checks ``generate`` makes, so a corrupt or foreign
trace is refused with its reason rather than converted into nonsense.
"""

from __future__ import annotations

from pathlib import Path

from workloads.trace_bundle import ET_FILE, TraceError, check_et_schema, rank_dirs, read_json


def _converter() -> type:
    try:
        from chakra.src.converter.pytorch_converter import PyTorchConverter
    except ImportError:
        raise TraceError("Chakra export needs the optional mlc-chakra package: pip install -e '.[chakra]' "
                         "(or pip install mlc-chakra)") from None
    return PyTorchConverter()


def export_chakra(bundle: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Convert every rank's ET of ``bundle``; returns the protobuf files written."""
    bundle = Path(bundle)
    ranks = rank_dirs(bundle)
    out = Path(out_dir) if out_dir is not None else bundle / "chakra"
    for rank_dir in ranks:  # validate all before writing any
        path = rank_dir / ET_FILE
        check_et_schema(read_json(path, "execution trace"), path)
    converter = _converter()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, rank_dir in enumerate(ranks):
        target = out / f"rank{i}.et"
        try:
            converter.convert(str(rank_dir / ET_FILE), str(target), False)
        except Exception as err:  # noqa: BLE001 - the converter raises anything; say which file
            reason = f"{type(err).__name__}: {err}"
            raise TraceError(f"mlc-chakra could not convert {rank_dir / ET_FILE}: {reason}") from None
        written.append(target)
    return written


def read_chakra(path: str | Path) -> tuple[dict, list[dict]]:
    """Decode a Chakra protobuf trace (as ``chakra_jsonizer`` does): (global metadata, nodes) as dicts."""
    try:
        from chakra.schema.protobuf.et_def_pb2 import GlobalMetadata, Node
        from chakra.src.third_party.utils.protolib import decodeMessage, openFileRd
        from google.protobuf.json_format import MessageToDict
    except ImportError:
        raise TraceError("reading Chakra traces needs the optional mlc-chakra package") from None
    stream = openFileRd(str(path))
    try:
        metadata = GlobalMetadata()
        decodeMessage(stream, metadata)
        nodes = []
        node = Node()
        while decodeMessage(stream, node):
            nodes.append(MessageToDict(node))
    finally:
        stream.close()
    return MessageToDict(metadata), nodes
