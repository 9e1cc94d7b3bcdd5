"""One trainer update under torch.profiler: where an update's time goes, operator by operator.

    python -m hybridrl trainer-profile --shape qwen3-0.6b --trainer megatron --micro-batch 32 --workdir W --out P.txt

The trainer runs in this process (Megatron at TP 1 in a one-process group, not under torchrun), on trainer_bench's
fixed batch: two warm-up updates, then one profiled (logprobs, loss, backward, optimizer step; with --export also
the adapter export and the wait for the optimizer state, as the loop's update_actor, save_adapter and save_state
phases run them, their labelled parts timed in a table of their own). The text written holds the update's wall time
and the operators sorted by their own time on the device (CUDA; the CPU where there is no GPU), so two trainers'
tables can be read side by side, then the same split by the operators' input shapes, which tells a norm's or an
adapter's elementwise work from the rest. On a GPU, one more update before the profiled one lists where the host
waited for the device (torch's sync debug mode): each wait empties the queue of kernels, so the host's launch time
no longer hides behind the GPU's work.
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from hybridrl.engines.server import free_port
from hybridrl.tools.trainer_bench import bench_run, check_megatron_permute, fixed_batch, shape_model, shape_of
from hybridrl.trainers.op_profile import operator_tables

WARMUP = 2


def _megatron_update(model: Path, run: Any, device: Any, megatron_permute: bool = False) -> tuple[Any, Any, Any]:
    """A TP 1 MegatronPolicy in this process; returns (one update on samples, the export to a dir, close).
    megatron_permute: MoE tokens permuted by megatron's own dispatcher (atomic scatters) instead of hybridrl's
    gathers, for a before-and-after."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hybridrl.trainers.megatron.policy import MegatronPolicy, init_parallel

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    init_parallel(1, device)
    policy = MegatronPolicy(model, run, device, megatron_permute)

    def close() -> None:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    def export(out_dir: Path) -> None:
        policy.save(out_dir)
        policy.flush()

    return (lambda samples: policy.step(samples)), export, close


def _hf_update(model: Path, run: Any, device: Any) -> tuple[Any, Any, Any]:
    from hybridrl.trainers.base import lora_b_norm
    from hybridrl.trainers.hf import HFTrainer

    trainer = HFTrainer(model, run, str(device))

    def export(out_dir: Path) -> None:  # what HFTrainer.step does after its update
        trainer.save(out_dir)
        lora_b_norm(trainer.adapter_params.items())
        trainer.flush()

    return trainer.update, export, trainer.close


def host_waits(update: Any, samples: Any) -> Counter[str]:
    """Where one update made the host wait for the GPU (a read of a device value, a blocking copy): torch's
    warning per wait, counted by the Python line that caused it. Waits in autograd's own threads (the backward)
    are not seen."""
    import torch

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            update(samples)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))


def waits_table(waits: Counter[str]) -> str:
    """The host's waits of one update, most frequent line first."""
    lines = [f"host waits for the GPU in one update: {sum(waits.values())} (torch.cuda sync debug mode)"]
    lines += [f"{n:8d}  {where}" for where, n in waits.most_common()]
    return "\n".join(lines) + "\n"


def check_options(shape_name: str, trainer: str, megatron_permute: bool) -> None:
    """ValueError for options that do not go together; checked before anything is built."""
    if megatron_permute:
        check_megatron_permute(shape_name, [trainer])


def ranges_table(events: Any) -> str:
    """The labelled ranges of a profiled update (hybridrl.update, hybridrl.export and the export's parts,
    export.*): each one's host time, total and per call, in the order of their totals."""
    # a range's GPU-side twin (no host time) is left out
    rows = sorted((e for e in events if e.key.startswith(("hybridrl.", "export.")) and e.cpu_time_total > 0),
                  key=lambda e: -e.cpu_time_total)
    lines = ["labelled ranges (host time):", f"{'range':28} {'calls':>6} {'total s':>9} {'per call s':>11}"]
    lines += [f"{e.key:28} {e.count:6d} {e.cpu_time_total / 1e6:9.4f} {e.cpu_time_total / 1e6 / e.count:11.4f}"
              for e in rows]
    return "\n".join(lines) + "\n"


def main(shape_name: str, trainer: str, device: str, workdir: Path, out: Path, micro_batch: int = 8,
         pack: bool = True, varied: bool = False, rows: int = 40, megatron_permute: bool = False,
         export: bool = False, vocab: int | None = None, chunked_head: bool = False) -> str:
    """Profile one update of `trainer` on the shape's fixed batch (and its export, with `export`); writes and
    returns the table."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    check_options(shape_name, trainer, megatron_permute)
    shape = shape_of(shape_name, vocab)
    workdir.mkdir(parents=True, exist_ok=True)
    model = shape_model(workdir, shape_name, shape, device)
    samples = fixed_batch(shape.config["vocab_size"], shape.samples, shape.prompt, shape.completion, varied=varied)
    run = bench_run(shape, trainer, device, micro_batch, None, pack, chunked_head)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
    update, export_to, close = (_megatron_update(model, run, dev, megatron_permute) if trainer == "megatron"
                                else _hf_update(model, run, dev))
    exports = itertools.count(1)  # a new adapter dir per export, as the loop's steps have

    def timed() -> float:
        t0 = time.perf_counter()
        with record_function("hybridrl.update"):
            update(samples)
            if device == "cuda":
                torch.cuda.synchronize(dev)
        if export:
            with record_function("hybridrl.export"):
                export_to(workdir / f"export-{trainer}" / f"adapter-{next(exports)}")
        return time.perf_counter() - t0

    try:
        for _ in range(WARMUP):
            timed()
        waits = host_waits(update, samples) if device == "cuda" else None
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=activities, record_shapes=True) as prof:
            wall = timed()
    finally:
        close()
    flags = ((" megatron-permute" if megatron_permute else "") + (" chunked-head" if chunked_head else "")
             + (" with its export" if export else ""))
    head = (f"trainer-profile {shape_name} {trainer} micro_batch {micro_batch} pack {pack} "
            f"lengths {'varied' if varied else 'fixed'} device {device}{flags}: profiled update {wall:.3f} s\n")
    text = (head + operator_tables(prof, device == "cuda", rows) + "\n"
            + ("" if waits is None else "\n" + waits_table(waits))
            + ("\n" + ranges_table(prof.key_averages()) if export else ""))
    from hybridrl.atomic import write_text

    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, text)
    print(text)
    return text
