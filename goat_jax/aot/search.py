"""The largest per-device batch that fits a target (:func:`largest_batch`), found with the real
compiler: MaxText's memory-estimator search, one compile per tried batch."""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, Optional, Sequence

from goat_jax.aot.compiler import GiB, compile_train_step
from goat_jax.aot.target import Target, target_devices


def with_batch(config: Any, per_device: int, remat: Optional[bool] = None, remat_field: str = "model.remat") -> Any:
    """A copy of ``config`` training ``per_device`` examples per device in one microbatch
    (``per_device_batch_size``, ``global_batch_size`` None, ``grad_accum_steps`` 1), with
    ``remat_field`` set to ``remat`` unless that is None. Turning it off also resets a
    ``<remat_field>_policy`` field beside it (``model.remat_policy``) to 'full', its default, which
    the model refuses to see set without rematerialization (an inert setting)."""
    c = copy.deepcopy(config)
    with c.unlocked():
        c.global_batch_size, c.per_device_batch_size, c.grad_accum_steps = None, int(per_device), 1
        if remat is not None:
            *path, name = remat_field.split(".")
            node = c
            for part in path:
                node = node[part]
            node[name] = bool(remat)
            if not remat and f"{name}_policy" in node:
                node[f"{name}_policy"] = "full"
    return c


def largest_batch(config: Any, target: Target, remat_options: Sequence[bool] = (False, True), start: int = 1,
                  max_compiles: int = 8, remat_field: str = "model.remat",
                  log: Callable[[str], None] = lambda _: None, compile_fn: Optional[Callable[..., Dict[str, Any]]] = None,
                  ) -> Dict[str, Any]:
    """The largest per-device batch of ``config`` (one microbatch: :func:`with_batch`) whose
    train step fits ``target``, for each ``remat_options`` value of ``remat_field``: the search
    MaxText's memory estimator makes, with the real compiler. From ``start`` the batch doubles
    while it fits (halves while it does not), then bisects between the last fitting and the first
    failing batch; at most ``max_compiles`` compiles per remat setting (the bracket is then
    reported as it stands). Returns ``{'target', 'per_remat': [{'remat', 'largest' (None: not
    even the smallest tried fits), 'first_failing' (None: never failed within the compiles),
    'exact' (the two are adjacent), 'tried': [{'per_device', 'fits', 'total_bytes',
    'compile_seconds'}], 'report' (the largest fitting batch's compile report)}]}``.
    ``compile_fn`` (default :func:`compile_train_step`) is the tests' hook."""
    compile_fn = compile_fn or compile_train_step
    if int(start) < 1 or int(max_compiles) < 1:
        raise ValueError(f"largest_batch: start={start} and max_compiles={max_compiles} must be >= 1.")
    devices = target_devices(target) if compile_fn is compile_train_step else None
    out: Dict[str, Any] = {"target": target.name, "per_remat": []}
    for remat in remat_options:
        tried: List[Dict[str, Any]] = []
        reports: Dict[int, Dict[str, Any]] = {}

        def attempt(b: int) -> bool:
            rep = compile_fn(with_batch(config, b, remat, remat_field), target,
                             **({"devices": devices} if devices is not None else {}))
            mem = rep.get("per_device_bytes") or {}
            total = mem.get("total", rep.get("compiler_used_bytes"))
            tried.append({"per_device": b, "fits": bool(rep["fits"]), "total_bytes": total,
                          "compile_seconds": rep.get("compile_seconds")})
            reports[b] = rep
            log(f"  {target.name} remat={remat} per-device batch {b}: "
                f"{'n/a' if total is None else f'{total / GiB:.2f} GiB'}, fits={rep['fits']}")
            return bool(rep["fits"])

        lo, hi, b = None, None, int(start)
        while len(tried) < max_compiles:  # bracket: double while it fits, halve while it does not
            if attempt(b):
                lo = b
            else:
                hi = b
            if lo is not None and hi is not None:
                break
            if lo is None and b == 1:
                break  # not even one example per device fits
            b = b * 2 if lo is not None else b // 2
        while lo is not None and hi is not None and hi - lo > 1 and len(tried) < max_compiles:
            mid = (lo + hi) // 2
            if attempt(mid):
                lo = mid
            else:
                hi = mid
        out["per_remat"].append({"remat": bool(remat), "largest": lo, "first_failing": hi,
                                 "exact": (lo is not None and hi is not None and hi - lo == 1) or (lo is None and hi == 1),
                                 "tried": tried, "report": reports.get(lo)})
    return out
