#!/usr/bin/env python3
"""DeepSpeed's own universal load, run in build/venv-deepspeed-0.19 (tests/formats/deepspeed/test_deepspeed_universal.py
starts it): each universal root given is loaded by `engine.load_checkpoint(root, load_universal=True)`
into the model the ZeRO fixture was trained with (fixtures/gen_deepspeed.py's FIXTURES: the same
model, optimizer groups and config, as many gloo ranks on CPU), and what DeepSpeed then holds is recorded, before and after one more
training step on the same batch: each trained parameter's fp32 master weights and Adam moments
(safe_get_full_fp32_param / safe_get_full_optimizer_state, gathered from every rank), the base
optimizer's steps and hyper-parameters, the engine's step counters and lr scheduler.

    python tests/deepspeed_universal_load.py OUT.json ZERO_FIXTURE ROOT [ROOT ...]

(ZERO_FIXTURE: the name of the ZeRO fixture the roots were converted from, e.g. deepspeed_z3_bf16)
"""
from __future__ import annotations

import json
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "fixtures"))

import gen_deepspeed as G  # noqa: E402


def _b64(t) -> dict:  # noqa: ANN001
    return G._tensor_json(t)


def _record(engine) -> dict:  # noqa: ANN001
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):  # (see gen_deepspeed.py: link every group's state)
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    out: dict = {"params": {}, "steps": [], "groups": []}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        out["params"][name] = {"fp32": _b64(safe_get_full_fp32_param(p)),
                               **{k: _b64(safe_get_full_optimizer_state(p, k)) for k in ("exp_avg", "exp_avg_sq")}}
    base = opt.optimizer
    for group in base.param_groups:
        out["groups"].append({k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"})
    # the flat tensors the base optimizer steps (stage 3 swaps each sub-group's into its group to step it)
    flats = getattr(opt, "fp32_partitioned_groups_flat", None) or [p for g in base.param_groups for p in g["params"]]
    for p in flats:
        step = base.state.get(p, {}).get("step")
        out["steps"].append(float(step) if isinstance(step, (int, float, torch.Tensor)) else None)
    out["global_steps"] = engine.global_steps
    out["global_samples"] = engine.global_samples
    sched = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    out["lr_scheduler"] = {k: v for k, v in (sched or {}).items() if isinstance(v, (int, float, str, bool, type(None)))}
    return out


def _rank(rank: int, port: int, out: str, fixture: str, roots: list[str]) -> None:
    stage, precision, world, kind = G.FIXTURES[fixture]
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import deepspeed
    import torch

    deepspeed.init_distributed(dist_backend="gloo")
    results = {}
    for root in roots:
        model = G._make_model(kind)
        optimizer = torch.optim.Adam(G._groups(model, kind), lr=1e-2)
        config = G._config(stage, precision, kind)
        config["checkpoint"] = {"load_universal": True}
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        path, client = engine.load_checkpoint(root, load_universal=True) if _takes_flag(engine) else \
            engine.load_checkpoint(root)
        assert path is not None, f"DeepSpeed loaded nothing from {root}"
        before = _record(engine)
        gen = torch.Generator().manual_seed(500 + rank)
        tokens = torch.randint(0, 30, (2, 8), generator=gen)
        logits = engine(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 30), tokens.roll(-1, 1).reshape(-1))
        engine.backward(loss)
        engine.step()
        after = _record(engine)
        results[root] = {"before": before, "after": after,
                         "client": {k: v for k, v in (client or {}).items() if k in ("run", "epoch")}}
        del engine
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _takes_flag(engine) -> bool:  # noqa: ANN001
    import inspect

    return "load_universal" in inspect.signature(engine.load_checkpoint).parameters


def main() -> None:
    import torch.multiprocessing as mp

    out, fixture, *roots = sys.argv[1:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_rank, args=(port, out, fixture, roots), nprocs=G.FIXTURES[fixture][2], join=True,
                       start_method="spawn")


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
