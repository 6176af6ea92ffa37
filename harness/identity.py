"""A benchmark's identity: the part of a config that says what is measured, its hash (equal hashes: comparable
runs on any platform), and the overrides that compose a recorded config again (``cobench reproduce``-style
re-runs, a suite's planned runs)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

from harness.config import CobenchConfig, compose_config

_NOT_MEASURED = ("progress", "noise_step_cv_max", "noise_rep_cv_max")  # how a run is shown or judged


def benchmark_config_dict(cfg: CobenchConfig | DictConfig) -> dict[str, Any]:
    """The part of the config that defines *what* is measured.

    Not where it runs (the platform is a tag of its own, so the same benchmark on two platforms
    has the same hash and lines up in comparisons), nor where results go, nor display options.
    """
    node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
    container = OmegaConf.to_container(node, resolve=True)
    assert isinstance(container, dict)
    runner = {k: v for k, v in container["runner"].items() if k not in _NOT_MEASURED}
    return {"seed": container["seed"], "deterministic": container["deterministic"], "runner": runner,
            "workload": container["workload"]}


def config_hash(cfg: CobenchConfig | DictConfig) -> str:
    """A short, stable hash of what is measured: equal hashes mean comparable runs, on any platform."""
    payload = json.dumps(benchmark_config_dict(cfg), sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


# where a run's outputs went, and how it was shown: the user's to choose again, not part of what was run
_NOT_REPRODUCED = ("results_dir", "tracking", "run_name", "runner.progress", "suite")


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a.b": value}`` for every leaf of a nested dict (lists are leaves)."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for key, value in node.items():
            out.update(_leaves(value, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): node}


def _override_value(value: Any) -> str:
    """A value in Hydra's override grammar (JSON is a subset for numbers, strings, lists and dicts)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value) if not re.fullmatch(r"[\w./~:+-]+", value) or value in ("null", "true", "false") \
            else value
    return json.dumps(value, separators=(",", ":"))


def reproduce_overrides(config: dict[str, Any]) -> list[str]:
    """The overrides that compose ``config`` (a run's resolved config, as its ``config.yaml`` holds it) again:
    the workload's choice, then every setting whose value differs from what that choice composes by default,
    the platform's included (``platform.num_threads=1`` run again at 1 thread). Where the outputs go
    (results_dir, tracking) is left to whoever reproduces it."""
    workload = config["workload"]["name"]
    default = OmegaConf.to_container(compose_config([f"workload={workload}"]), resolve=True)
    assert isinstance(default, dict)
    mine, theirs = _leaves(config), _leaves(default)
    overrides = [f"workload={workload}"]
    for key, value in mine.items():
        if key.startswith(_NOT_REPRODUCED) or key in ("workload.name",):
            continue
        if key not in theirs:
            overrides.append(f"+{key}={_override_value(value)}")
        elif theirs[key] != value:
            overrides.append(f"{key}={_override_value(value)}")
    return overrides
