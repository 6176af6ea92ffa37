"""Which ops a replay may run: the one place that says it.

Only ops that compute on tensors replay: the compute libraries torch ships and the ones the replay
loads itself (fbgemm, torchrec, torchvision), and collectives on the replay's own process group.
Refused: ops that reach a file (``aten::from_file`` and any op with a path argument), ops that lay
a tensor over a raw storage (``set_`` from a ``Storage``), ops that change process-wide state
(reseeding the global generators, autograd mode, library caches), profiler annotations and
printing, and every other namespace (a user's ``torch.library`` ops included).
"""

from __future__ import annotations

import re
from typing import Any

import torch

# Namespaces whose ops may replay: compute libraries that torch itself ships, the ones the replay
# loads on demand (fbgemm_gpu, torchrec, torchvision), and collectives, which run through torch.distributed on
# the replay's own process group.
ALLOWED_NAMESPACES: dict[str, str] = {
    "aten": "PyTorch's tensor operators",
    "prims": "PyTorch's primitive operators",
    "fbgemm": "FBGEMM's embedding and quantisation kernels (fbgemm_gpu)",
    "torchrec": "TorchRec's operators",
    "torchvision": "torchvision's detection kernels (NMS, RoI align and pooling, deformable convolution)",
    "quantized": "PyTorch's quantised kernels",
    "mkldnn": "oneDNN kernels shipped with PyTorch",
    "onednn": "oneDNN kernels shipped with PyTorch",
    "fsdp": "FSDP2's copy-in/out kernels, shipped with PyTorch",
    "c10d": "collectives, replayed on the replay's own process group",
    "_c10d_functional": "functional collectives on the replay's process group",
}
# Ops of allowed namespaces that reach outside the process's tensors; by name, every overload.
REFUSED_OPS: dict[str, str] = {
    "aten::from_file": "maps a file into a tensor (reads and writes files)",
    "aten::save": "writes a file",
    "aten::_print": "writes to the process's output",
    "aten::warn": "writes to the process's output",
    "aten::manual_seed": "reseeds a process-wide random generator",
    "aten::seed": "reseeds a process-wide random generator",
    "aten::set_grad_enabled": "changes the process's autograd mode",
    "aten::_set_deterministic_algorithms": "changes a process-wide setting",
    "aten::_cufft_set_plan_cache_max_size": "changes a process-wide library cache",
    "aten::_cufft_clear_plan_cache": "changes a process-wide library cache",
    "aten::_record_function_enter": "profiler annotation, not tensor work",
    "aten::_record_function_enter_new": "profiler annotation, not tensor work",
    "aten::_record_function_exit": "profiler annotation, not tensor work",
    "aten::record_stream": "hands a tensor to another stream's allocator, not tensor work",
    "fbgemm::new_managed_tensor": "maps host memory (unified memory), not tensor work",
    "fbgemm::new_host_mapped_tensor": "maps host memory, not tensor work",
    "fbgemm::new_vanilla_managed_tensor": "maps host memory, not tensor work",
    "fbgemm::new_unified_tensor": "maps host memory, not tensor work",
    "fbgemm::cuda_mem_advise": "changes the driver's memory policy",
    "fbgemm::cuda_mem_prefetch_async": "changes the driver's memory placement",
    "fbgemm::uvm_mem_advice_dont_fork": "changes the driver's memory policy",
    "fbgemm::uvm_to_cpu": "maps host memory, not tensor work",
    "fbgemm::uvm_to_device": "maps host memory, not tensor work",
    "fbgemm::check_feature_gate_key": "reads the process's configuration",
}
# Schema arguments that make an op reach outside its tensors, whatever its name.
_PATH_ARGUMENT = re.compile(r"(?i)^(file(name|path)?|path|dir(ectory)?|url)$")


def op_refusal(name: str, schema: str) -> str | None:
    """Why the op a spec names may not replay, or None when it may.

    Both the op's name and its schema's qualified name are checked: the schema is what the
    replay calls, the name what collectives are dispatched by.
    """
    for qualified in {name, schema.split("(", 1)[0]}:
        base = qualified.split(".", 1)[0]
        namespace = base.split("::", 1)[0]
        if namespace not in ALLOWED_NAMESPACES:
            return f"namespace '{namespace}::' is not one a replay calls"
        if base in REFUSED_OPS:
            return REFUSED_OPS[base]
    if name.startswith("c10d::"):
        return None  # run through torch.distributed, never through this schema
    try:
        arguments = torch._C.parse_schema(schema).arguments
    except RuntimeError:
        return None  # the replay cannot call it either: recorded as a failed op
    for arg in arguments:
        arg_type = str(arg.type)
        if "Storage" in arg_type:
            return f"lays a tensor over a raw storage (argument '{arg.name}: {arg_type}')"
        if "str" in arg_type and _PATH_ARGUMENT.match(arg.name):
            return f"takes a path (argument '{arg.name}')"
    return None


def refused_ops(spec: dict[str, Any]) -> dict[str, str]:
    """Every op of a (structurally valid) spec the policy refuses: qualified name → why."""
    found: dict[str, str] = {}
    for rank in spec["ranks"]:
        for op in rank["ops"]:
            reason = op_refusal(op["name"], op["schema"])
            if reason is not None:
                found.setdefault(op["schema"].split("(", 1)[0], reason)
    return found
