"""`python -m hybridrl <command>`: the entry points that the Snakemake rules call."""

from __future__ import annotations

import argparse
import errno
import json
import sys
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from hybridrl.atomic import check_writable, write_text
from hybridrl.engines.base import ROLLOUT_PATHS as BENCH_PATHS
from hybridrl.study.config import ConfigError, load_study, read_run_spec

# the trainer tools' switch to the model's full logits: the output head's before-and-after within one lease
CHUNKED_HEAD = "the trainers with the chunked output head (chunked_head true), not the model's full logits"


def _validate(args: argparse.Namespace) -> None:
    from hybridrl.task.lengths import check_study

    study = load_study(args.config)
    check_study(study, Path(args.resources), args.config)
    for rid, run in study.runs.items():
        print(f"{rid}\t{run.engine}\t{run.placement}\t{run.trainer}\t{run.model}\t{run.steps} steps")
    for name, job in study.measurements.items():
        print(f"{name}\t{job.kind}\t{job.run_id or '-'}\t{job.output}")
    print(f"node: {study.node.gpus or 'any'} GPUs, jobs {study.node.sharing.replace('_', ' ')}")


def _status(args: argparse.Namespace) -> None:
    from hybridrl.report import status

    results = Path(args.results)
    rows = status.study_status(load_study(args.config), results,
                               Path(args.logs) if args.logs else results.parent / "logs")
    if args.json:
        print(status.as_json(rows))
    elif sys.stdout.isatty():
        status.print_rich(rows)
    else:
        print(status.as_text(rows))


def _schema(args: argparse.Namespace) -> None:
    from hybridrl.study.config import SCHEMA, schema_text

    current = SCHEMA.read_text()
    wanted = schema_text()
    if args.check:
        if wanted != current:
            raise SystemExit(f"{SCHEMA} is out of date with hybridrl.study's typed study: run `python -m hybridrl "
                             "schema`")
        print(f"{SCHEMA}: up to date")
        return
    write_text(SCHEMA, wanted)
    print(f"{SCHEMA}: {'unchanged' if wanted == current else 'written'}")


def _data(args: argparse.Namespace) -> None:
    from hybridrl.task import data

    out = Path(args.out)
    if args.source == "gsm8k":
        data.download_gsm8k(out)
    else:
        data.write_synthetic(out, args.n_train, args.n_test, args.seed, args.steps)


def _model(args: argparse.Namespace) -> None:
    from hybridrl.study.models import parse_spec, prepare

    prepare(parse_spec(args.spec), Path(args.corpus), Path(args.out), Path(args.test) if args.test else None)


def _train(args: argparse.Namespace) -> None:
    from hybridrl.run.cores import apply_trainer_threads, job_cores, split_cores
    from hybridrl.run.loop import run_loop

    spec = read_run_spec(Path(args.run_config))
    model_dir, data_dir, out = Path(args.model), Path(args.data), Path(args.out)
    for what, path in (("model", model_dir), ("data", data_dir)):
        if not path.exists():
            raise FileNotFoundError(f"{what} directory {path} does not exist")
    cores = split_cores(spec.run, job_cores())
    apply_trainer_threads(spec.run, cores)  # here, not in run_loop: it sets the whole process's thread pools
    records = run_loop(spec.run, spec.run_id, model_dir, data_dir, out, spec.engine_env,
                       progress=not args.no_progress, cores=cores)
    summary = {"run_id": spec.run_id, "steps": len(records)}
    write_text(Path(args.done), json.dumps(summary))


def _bench(args: argparse.Namespace) -> None:
    from hybridrl.tools.engine_bench import main as bench_main

    check_writable(Path(args.out))
    overrides = dict(args.set)
    bench_main(Path(args.run_config), Path(args.model), Path(args.data), Path(args.run_dir), args.step,
               args.repeats, Path(args.out), probe=args.probe, overrides=overrides, paths=tuple(args.paths))


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def _key_value(text: str) -> tuple[str, Any]:
    """argparse type of a run key set on the command line: KEY=VALUE, the value read as YAML (3 is a number)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, yaml.safe_load(value)
    except yaml.YAMLError:
        return key, value


def _fraction(text: str) -> float:
    """argparse type of a share (of requests streamed): a number from 0 to 1."""
    x = _number(text)
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must be from 0 to 1, got {x:g}")
    return x


def _seconds(text: str) -> float:
    """argparse type of a duration: a number of seconds, 0 or more."""
    x = _number(text)
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 seconds or more, got {x:g}")
    return x


def _at_least_one(text: str) -> int:
    """argparse type of a count (updates, samples, micro-batch sizes): a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _preflight(command: str, *checks: Callable[[], object]) -> None:
    """The trainer tools' argument checks (shape names, options that do not go together), run before any model
    is built: a refusal is one line and exit 2. The shape list is not given to argparse as choices because
    importing it costs the CLI too much."""
    try:
        for check in checks:
            check()
    except ValueError as exc:
        print(f"hybridrl {command}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _trainer_bench(args: argparse.Namespace) -> None:
    from hybridrl.tools.trainer_bench import check_device, check_options, shape_of
    from hybridrl.tools.trainer_bench import main as trainer_bench_main

    _preflight("trainer-bench", partial(shape_of, args.shape, args.vocab),
               partial(check_options, args.shape, args.trainer, args.peft_lora, args.megatron_permute, args.ep,
                       args.ep_dispatch, args.ep_batch, args.profile),
               partial(check_device, args.device))
    if args.out:
        check_writable(Path(args.out))
    trainer_bench_main(args.shape, args.trainer, args.updates, args.device, Path(args.workdir),
                       Path(args.out) if args.out else None, micro_batch=args.micro_batch,
                       micro_batch_tokens=args.micro_batch_tokens, samples=args.samples, pack=not args.no_pack,
                       varied=args.varied, peft_lora=args.peft_lora, megatron_permute=args.megatron_permute,
                       vocab=args.vocab, chunked_head=args.chunked_head, ep=args.ep, ep_dispatch=args.ep_dispatch,
                       ep_batch=args.ep_batch, profile=args.profile)


def _trainer_profile(args: argparse.Namespace) -> None:
    from hybridrl.tools.trainer_bench import check_device, shape_of
    from hybridrl.tools.trainer_profile import check_options
    from hybridrl.tools.trainer_profile import main as profile_main

    _preflight("trainer-profile", partial(shape_of, args.shape, args.vocab),
               partial(check_options, args.shape, args.trainer, args.megatron_permute),
               partial(check_device, args.device))
    check_writable(Path(args.out))
    profile_main(args.shape, args.trainer, args.device, Path(args.workdir), Path(args.out),
                 micro_batch=args.micro_batch, pack=not args.no_pack, varied=args.varied,
                 megatron_permute=args.megatron_permute, export=args.export, vocab=args.vocab,
                 chunked_head=args.chunked_head)


def _client_ceiling(args: argparse.Namespace) -> None:
    from hybridrl.engines.client_ceiling import main as ceiling_main

    if args.out:
        check_writable(Path(args.out))
    ceiling_main(args.format, args.requests, args.tokens, args.concurrency, args.stream_fraction,
                 args.tokens_per_event, args.seconds, args.procs, Path(args.out) if args.out else None,
                 old_client=not args.no_old_client)


def _client_gil(args: argparse.Namespace) -> None:
    from hybridrl.tools.client_gil import check_update_options
    from hybridrl.tools.client_gil import main as gil_main
    from hybridrl.tools.trainer_bench import check_device

    workdir = Path(args.workdir) if args.workdir else None
    _preflight("client-gil", partial(check_device, args.device),
               partial(check_update_options, args.trainer, args.shape, workdir))
    if args.out:
        check_writable(Path(args.out))
    gil_main(args.format, args.stream_fraction, args.requests, args.tokens, args.event_interval, args.ops,
             args.repeats, Path(args.out) if args.out else None, device=args.device, trainer=args.trainer,
             shape=args.shape, workdir=workdir, micro_batch=args.micro_batch)


def _fault_run(args: argparse.Namespace) -> None:
    from hybridrl.tools.fault_run import fault_run, run_dir_of, write

    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise SystemExit("hybridrl fault-run: give the run's command after --")
    try:
        run_dir = run_dir_of(cmd)
    except ValueError as exc:
        raise SystemExit(f"hybridrl fault-run: {exc}") from None
    if args.out:
        check_writable(Path(args.out))
    report = fault_run(cmd, run_dir, args.kill_engine_at, args.term_at)
    if args.out:
        write(report, Path(args.out))
    for line in report.problems:
        print(f"fault-run: {line}")
    print(f"fault-run: {'ok' if report.ok else 'FAILED'}: starts exited {report.exit_codes}, steps "
          f"{report.steps}, engine restarts {report.engine_restarts}, leftover processes {report.leftover}")
    if not report.ok:
        raise SystemExit(1)


def _peer_trl(args: argparse.Namespace) -> None:
    from hybridrl.tools.peer_trl import PeerOptions, check_options
    from hybridrl.tools.peer_trl import main as peer_main

    spec = read_run_spec(Path(args.run_config))
    device = args.device or spec.run.device
    gc = {"default": None, "on": True, "off": False}[args.gradient_checkpointing]
    opts = PeerOptions(steps=args.steps or spec.run.steps, micro_batch=args.micro_batch, device=device,
                       gradient_checkpointing=gc, lr=args.lr, vllm_sleep=not args.vllm_awake)
    _preflight("peer-trl", partial(check_options, spec.run, opts))
    for what, path in (("model", Path(args.model)), ("data", Path(args.data))):
        if not path.exists():
            raise FileNotFoundError(f"{what} directory {path} does not exist")
    try:
        import trl  # noqa: F401  (imported here so that a missing TRL is one line, not a traceback)
    except ImportError:
        raise SystemExit("hybridrl peer-trl: TRL is not installed (requirements/controller.lock.txt pins it; on the "
                         "GPU machine it is the overlay `lease.sh prepare ... peer` packs)") from None
    check_writable(Path(args.out))
    out = Path(args.out)
    peer_main(spec.run_id, spec.run, Path(args.model), Path(args.data), out, opts,
              Path(args.workdir) if args.workdir else out.parent / f"{out.stem}.trl")


def _start_bench(args: argparse.Namespace) -> None:
    from hybridrl.tools.start_bench import main as start_main

    spec = read_run_spec(Path(args.run_config))
    if not Path(args.model).exists():
        raise FileNotFoundError(f"model directory {args.model} does not exist")
    check_writable(Path(args.out))
    out = Path(args.out)
    start_main(spec.run_id, spec.run, Path(args.model), spec.engine_env, out,
               Path(args.log_dir) if args.log_dir else out.parent / f"{out.stem}.logs", args.repeats,
               spec.run.startup_timeout_s)


def _bench_parse(args: argparse.Namespace) -> None:
    from hybridrl.task.answer import bench

    print(f"{'case':36} {'chars':>8} {'ms':>8} {'Mchar/s':>8}")
    for name, chars, seconds in bench(args.repeats):
        print(f"{name:36} {chars:8d} {seconds * 1e3:8.2f} {chars / seconds / 1e6:8.2f}")


def _interval_coverage(args: argparse.Namespace) -> None:
    from hybridrl.report.coverage import REFERENCE, summary
    from hybridrl.report.coverage import main as coverage_main

    check_writable(Path(args.out))
    reference = Path(args.reference) if args.reference else REFERENCE
    print(summary(coverage_main(Path(args.out), args.noise_studies, sims=args.sims, seed=args.seed,
                                n_boot=args.n_boot, split_n_boot=args.split_n_boot, reference=reference)))


def _aggregate(args: argparse.Namespace) -> None:
    from hybridrl.report import aggregate_main

    aggregate_main([Path(p) for p in args.runs], Path(args.csv), Path(args.parquet))


def _report(args: argparse.Namespace) -> None:
    from hybridrl.report import report_main
    from hybridrl.report.peer import BenchRecordError

    try:
        report_main(Path(args.table), Path(args.md), Path(args.html), Path(args.plots), args.title)
    except BenchRecordError as exc:  # a measurement's result beside the runs: the report is not written
        raise SystemExit(f"hybridrl report: {exc}") from None


def _figures(args: argparse.Namespace) -> None:
    from hybridrl.report.figures import main as figures_main

    try:
        bad = figures_main([Path(f) for f in args.files], args.fix)
    except (ValueError, KeyError, OSError) as exc:  # a figure naming a missing file, run, column or field
        raise SystemExit(f"hybridrl figures: {exc}") from None
    if bad:
        raise SystemExit(1)


def _reports(args: argparse.Namespace) -> None:
    from hybridrl.report import refresh
    from hybridrl.report.peer import BenchRecordError

    try:
        dirs = refresh.study_dirs([Path(d) for d in args.dirs])
        if args.fix:
            refresh.refresh(dirs)
            return
        old = refresh.stale(dirs)
    except (FileNotFoundError, BenchRecordError) as exc:
        raise SystemExit(f"hybridrl reports: {exc}") from None
    for d in old:
        print(f"{d}/report.md: today's report code renders it differently")
    if old:
        raise SystemExit(f"hybridrl reports: {len(old)} of {len(dirs)} reports are stale; write them again with "
                         f"python -m hybridrl reports --fix {' '.join(map(str, old))}")
    print(f"hybridrl reports: all {len(dirs)} reports read as today's code renders them")


def _results_index(args: argparse.Namespace) -> None:
    from hybridrl.report import results_index

    try:
        print(results_index.write(Path(args.reference), Path(args.out), check=args.check))
    except results_index.StudyIndexError as exc:
        raise SystemExit(f"hybridrl results-index: {exc}") from None


def _targets(args: argparse.Namespace) -> None:
    from hybridrl.report import peer, target_status, targets

    try:
        wanted = targets.load(Path(args.targets))
        for row in target_status.rows(Path(args.reference), wanted):
            print(" | ".join(row))
    except (ConfigError, peer.BenchRecordError) as exc:
        raise SystemExit(f"hybridrl targets: {exc}") from None


def _archive(args: argparse.Namespace) -> None:
    from hybridrl.tools.archive import pack

    pack(Path(args.results), [Path(p) for p in args.extra], Path(args.out), root=Path(args.root),
         run_ids=args.runs, bench=args.bench)


def _compact(args: argparse.Namespace) -> None:
    from hybridrl.run.request_records import compact

    for run in args.runs:  # a run that died in its first step has its requests and no steps.jsonl yet
        if not (Path(run) / "steps.jsonl").is_file() and not (Path(run) / "requests").is_dir():
            raise SystemExit(f"hybridrl compact: {run} is not a run directory (no steps.jsonl, no requests/)")
    for run in args.runs:
        done = compact(Path(run))
        print(f"{run}: {done.files} request files gzipped, {done.before / 1e6:.2f} MB -> {done.after / 1e6:.2f} MB")


def _verify(args: argparse.Namespace) -> None:
    from hybridrl.tools.archive import verify

    problems = verify(Path(args.archive))
    if problems:
        raise SystemExit("archive verification failed:\n" + "\n".join(f"  {p}" for p in problems))
    print(f"{args.archive}: ok")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridrl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("validate", help="check a study config and list its runs")
    s.add_argument("--config", required=True)
    s.add_argument("--resources", default="resources",
                   help="where the workflow builds data/ and models/: the prompts' lengths are checked once built")
    s.set_defaults(fn=_validate)

    s = sub.add_parser("schema", help="write workflow/schemas/config.schema.yaml from the typed study "
                       "(StudyConfig, RunConfig)")
    s.add_argument("--check", action="store_true", help="fail if the committed schema differs, write nothing")
    s.set_defaults(fn=_schema)

    s = sub.add_parser("data", help="download GSM8K or synthesise GSM8K-format problems")
    s.add_argument("--source", choices=["gsm8k", "synthetic"], required=True)
    s.add_argument("--n-train", type=int, default=512)
    s.add_argument("--n-test", type=int, default=128)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--steps", type=int, default=1, choices=[1, 2, 3],
                   help="synthetic: most arithmetic steps per problem (1: the original one-step problems)")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=_data)

    s = sub.add_parser("model", help="download a model or build a random-init one")
    s.add_argument("--spec", required=True, help="the model's config entry as JSON")
    s.add_argument("--corpus", required=True, help="train.jsonl used to build a tokenizer for init: random")
    s.add_argument("--test", help="test.jsonl on which a warm-started model's base accuracy is measured")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=_model)

    s = sub.add_parser("train", help="run (or resume) one configuration")
    s.add_argument("--run-config", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--done", required=True, help="marker written after the last step")
    s.add_argument("--no-progress", action="store_true")
    s.set_defaults(fn=_train)

    s = sub.add_parser("bench", help="one engine alone on the request set of step N of a run")
    s.add_argument("--run-config", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--run-dir", required=True, help="the run's output dir (adapters/, steps.jsonl)")
    s.add_argument("--step", type=_at_least_one, default=3)
    s.add_argument("--repeats", type=_at_least_one, default=3)
    s.add_argument("--out", required=True, help="JSON result")
    s.add_argument("--probe", action="store_true", help="server engines: raw HTTP sleep/wake and adapter checks")
    s.add_argument("--paths", nargs="+", choices=BENCH_PATHS, default=list(BENCH_PATHS),
                   help="which rollout paths to measure in each repeat (the others are given as shares of raw)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", type=_key_value,
                   help="override a run key for the standalone engine, e.g. sglang_release=all (VALUE read as YAML)")
    s.set_defaults(fn=_bench)

    s = sub.add_parser("trainer-bench", help="both trainers on a fixed batch per shape: best and median of N "
                       "updates, tokens/s, MFU, peak memory")
    s.add_argument("--shape", default="qwen3-0.6b", help="qwen3-0.6b, qwen3-30b-a3b, tiny, tiny-moe")
    s.add_argument("--trainer", nargs="+", choices=["hf", "megatron"], default=["hf", "megatron"])
    s.add_argument("--updates", type=_at_least_one, default=5, help="timed updates, after one warm-up")
    s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    s.add_argument("--samples", type=_at_least_one, help="override the shape's batch size")
    s.add_argument("--micro-batch", type=_at_least_one, default=8)
    s.add_argument("--micro-batch-tokens", type=_at_least_one,
                   help="size micro-batches by the tokens a forward computes instead (packed: their sum)")
    s.add_argument("--no-pack", action="store_true", help="pad every row to the longest (pack_sequences false)")
    s.add_argument("--varied", action="store_true",
                   help="completion lengths drawn from completion/8 .. completion instead of all equal")
    s.add_argument("--peft-lora", action="store_true",
                   help="the hf trainer with PEFT's own adapter forward (scale and add outside the matmul)")
    s.add_argument("--megatron-permute", action="store_true",
                   help="the megatron trainer with megatron's own MoE token permutation (atomic scatters), not "
                   "hybridrl's gathers")
    s.add_argument("--vocab", type=int, help="output rows of the model (default: the shape's 768, or 64 for the "
                   "tiny shapes); 151936 is Qwen3's")
    s.add_argument("--chunked-head", action="store_true", help=CHUNKED_HEAD)
    s.add_argument("--ep", type=_at_least_one, default=1,
                   help="the megatron trainer on a MoE shape sharded over this many GPUs by expert parallelism "
                   "(train_ep): each holds 1/N of the experts and a replica of the rest")
    s.add_argument("--ep-dispatch", choices=["host_read", "masked"], default="host_read",
                   help="at --ep 2 or more, how a rank picks its experts' rows (the run key ep_dispatch): host_read "
                   "reads their ends on the host once a MoE layer, masked keeps every row and masks the others'")
    s.add_argument("--ep-batch", choices=["replicated", "split"], default="replicated",
                   help="at --ep 2 or more, whether every rank runs the whole batch or its share of it (the run key "
                   "ep_batch)")
    s.add_argument("--profile", action="store_true",
                   help="after the timed updates, one more megatron update under torch.profiler in every worker: "
                   "its operators' tables beside --out (OUT.profile-rankK.txt), at any --ep")
    s.add_argument("--workdir", required=True, help="the random-init model and the adapters go here")
    s.add_argument("--out", help="JSON result")
    s.set_defaults(fn=_trainer_bench)

    s = sub.add_parser("trainer-profile", help="one trainer update under torch.profiler: the operators that take "
                       "its time, in this process (Megatron at TP 1)")
    s.add_argument("--shape", default="qwen3-0.6b", help="qwen3-0.6b, qwen3-30b-a3b, tiny, tiny-moe")
    s.add_argument("--trainer", choices=["hf", "megatron"], required=True)
    s.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    s.add_argument("--micro-batch", type=_at_least_one, default=8)
    s.add_argument("--no-pack", action="store_true", help="pad every row to the longest (pack_sequences false)")
    s.add_argument("--varied", action="store_true", help="completion lengths drawn from completion/8 .. completion")
    s.add_argument("--megatron-permute", action="store_true",
                   help="MoE tokens permuted by megatron's own dispatcher (atomic scatters), not hybridrl's gathers")
    s.add_argument("--export", action="store_true",
                   help="profile the adapter export and the optimizer state's write after the update too")
    s.add_argument("--vocab", type=int, help="output rows of the model (default: the shape's 768, or 64 for the "
                   "tiny shapes); 151936 is Qwen3's")
    s.add_argument("--chunked-head", action="store_true", help=CHUNKED_HEAD)
    s.add_argument("--workdir", required=True, help="the random-init model goes here")
    s.add_argument("--out", required=True, help="the operator table (text)")
    s.set_defaults(fn=_trainer_profile)

    s = sub.add_parser("fault-run", help="one run hit on purpose (engine SIGKILL in a rollout, SIGTERM in "
                       "training), started again after the SIGTERM, then checked: steps, restarts, leftovers")
    s.add_argument("--kill-engine-at", type=_at_least_one, help="step whose rollout loses its engine (SIGKILL)")
    s.add_argument("--term-at", type=_at_least_one, help="step whose training gets SIGTERM, as SLURM preemption sends")
    s.add_argument("--out", help="JSON report")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- python -m hybridrl train ... --out RUN_DIR")
    s.set_defaults(fn=_fault_run)

    s = sub.add_parser("peer-trl", help="TRL's GRPOTrainer on a run's model, prompts, reward and batch: its step and "
                       "phases from TRL's timers and a trainer callback")
    s.add_argument("--run-config", required=True, help="the run it mirrors (results/runs/<id>/config.json)")
    s.add_argument("--model", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--steps", type=_at_least_one, help="optimizer steps (default: the run's)")
    s.add_argument("--micro-batch", type=_at_least_one, default=32,
                   help="completions a forward (TRL's per_device_train_batch_size); must divide the step's batch")
    s.add_argument("--gradient-checkpointing", choices=["default", "on", "off"], default="default",
                   help="default: TRL's own (on)")
    s.add_argument("--lr", type=_number, help="learning rate (default: the run's)")
    s.add_argument("--vllm-awake", action="store_true",
                   help="vLLM stays awake beside the model (TRL's vllm_enable_sleep_mode off); default: it sleeps")
    s.add_argument("--device", choices=["cuda", "cpu"], help="default: the run's")
    s.add_argument("--workdir", help="TRL's output_dir (default: beside --out)")
    s.add_argument("--out", required=True, help="JSON result")
    s.set_defaults(fn=_peer_trl)

    s = sub.add_parser("client-ceiling", help="the most tokens/s the rollout client absorbs here (fake engine, no GPU)")
    s.add_argument("--format", choices=["sglang", "vllm"], nargs="+", default=["sglang", "vllm"])
    s.add_argument("--requests", type=_at_least_one, default=128)
    s.add_argument("--tokens", type=_at_least_one, default=256, help="tokens per request")
    s.add_argument("--concurrency", type=_at_least_one, default=128)
    s.add_argument("--stream-fraction", type=_fraction, nargs="+", default=[1.0, 0.125, 0.0],
                   help="shares of requests streamed (1: every request, the old path)")
    s.add_argument("--tokens-per-event", type=_at_least_one, nargs="+", default=[1, 20],
                   help="stream granularity: SGLang sends 1, vLLM about 20 under load")
    s.add_argument("--seconds", type=_seconds, default=3.0,
                   help="per setting: batches until this much time passed (0: one batch)")
    s.add_argument("--procs", type=_at_least_one, default=1, help="fake engine processes")
    s.add_argument("--no-old-client", action="store_true",
                   help="leave out the earlier client (one shared pool, every request streamed)")
    s.add_argument("--out", help="JSON with every setting's figures")
    s.set_defaults(fn=_client_ceiling)

    s = sub.add_parser("client-gil", help="how long a loop of torch operators (or one trainer update) takes beside "
                       "the rollout client: in a thread of this process, in a worker process (rollout_process), or "
                       "with none")
    s.add_argument("--format", choices=["sglang", "vllm"], nargs="+", default=["sglang", "vllm"])
    s.add_argument("--stream-fraction", type=_fraction, nargs="+", default=[0.0, 0.125],
                   help="shares of requests streamed (0.125: the runs' default)")
    s.add_argument("--requests", type=_at_least_one, default=128)
    s.add_argument("--tokens", type=_at_least_one, default=256, help="tokens per request")
    s.add_argument("--event-interval", type=_seconds, default=0.006,
                   help="seconds between one request's tokens at the fake engine (0.006: 128 x 256 tokens in "
                        "about 1.6 s, an H200's pace on the dense model)")
    s.add_argument("--ops", type=_at_least_one, default=15000, help="rounds of the loop")
    s.add_argument("--repeats", type=_at_least_one, default=5, help="median of this many loops per mode")
    s.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the loop's operators (or the update) run: cuda times real kernel launches")
    s.add_argument("--trainer", choices=["hf", "megatron"],
                   help="time one update of this trainer (trainer-bench's fixed batch) instead of the loop")
    s.add_argument("--shape", default="qwen3-0.6b", help="with --trainer: qwen3-0.6b, qwen3-30b-a3b, tiny, tiny-moe")
    s.add_argument("--micro-batch", type=_at_least_one, default=32, help="with --trainer: samples a pass")
    s.add_argument("--workdir", help="with --trainer: the random-init model and the adapters go here")
    s.add_argument("--out", help="JSON with every setting's figures")
    s.set_defaults(fn=_client_gil)

    s = sub.add_parser("bench-parse", help="answer parsing on its worst cases (whitespace runs, long digit runs)")
    s.add_argument("--repeats", type=_at_least_one, default=5, help="best of this many runs per case")
    s.set_defaults(fn=_bench_parse)

    s = sub.add_parser("interval-coverage", help="how often the reports' 95%% intervals hold the truth: simulated "
                       "arms with the studies' run and step noise, and 3-vs-3 splits of replicated configurations")
    s.add_argument("--out", required=True, help="JSON with every design's coverage and the null splits")
    s.add_argument("--noise-studies", nargs="+", required=True, metavar="STUDY",
                   help="the committed verdict studies (folders under --reference) whose run and step noise the "
                        "simulation takes, each one lease of like arms with several runs")
    s.add_argument("--reference", help="the folder of committed studies, the noise studies' and every null "
                   "split's (default: the repository's results/reference)")
    s.add_argument("--sims", type=_at_least_one, default=1500, help="simulated pairs per design and ratio")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--n-boot", type=_at_least_one, default=2000,
                   help="bootstrap draws per simulated interval (the reports draw 5000)")
    s.add_argument("--split-n-boot", type=_at_least_one, default=5000, help="bootstrap draws per null-split interval")
    s.set_defaults(fn=_interval_coverage)

    s = sub.add_parser("aggregate", help="gather runs into one tidy table")
    s.add_argument("--runs", nargs="+", required=True)
    s.add_argument("--csv", required=True)
    s.add_argument("--parquet", required=True)
    s.set_defaults(fn=_aggregate)

    s = sub.add_parser("report", help="report.md/html with plots and confidence intervals")
    s.add_argument("--table", required=True)
    s.add_argument("--md", required=True)
    s.add_argument("--html", required=True)
    s.add_argument("--plots", required=True)
    s.add_argument("--title", default="hybridrl study")
    s.set_defaults(fn=_report)

    s = sub.add_parser("figures", help="check the README figures marked <!--fig ...--> against the committed data")
    s.add_argument("files", nargs="+")
    s.add_argument("--fix", action="store_true", help="write the data's figures into the files")
    s.set_defaults(fn=_figures)

    s = sub.add_parser("reports", help="check committed study reports (report.md) against today's report code")
    s.add_argument("dirs", nargs="+", help="study folders (steps.csv, report.md, plots/); others are passed over")
    s.add_argument("--fix", action="store_true", help="render report.md and the plots again")
    s.set_defaults(fn=_reports)

    s = sub.add_parser("status", help="each run of a study: steps done of planned, state, the last step's time and "
                       "gates, its log")
    s.add_argument("--config", required=True)
    s.add_argument("--results", default="results", help="the study's results folder (runs/<run id>/ in it)")
    s.add_argument("--logs", help="the logs folder (train/<run id>.log in it; default: logs/ beside --results)")
    s.add_argument("--json", action="store_true", help="print the rows as JSON, for scripts")
    s.set_defaults(fn=_status)

    s = sub.add_parser("results-index", help="write results/README.md: every committed study, newest first, with its "
                       "machine, question, finding and status, from each study's README")
    s.add_argument("--reference", default="results/reference", help="the folder of committed studies")
    s.add_argument("--out", default="results/README.md")
    s.add_argument("--check", action="store_true", help="fail if OUT differs from what would be written, write nothing")
    s.set_defaults(fn=_results_index)

    s = sub.add_parser("start-bench", help="a run's engine started through hybridrl against the same engine "
                       "started bare by its own command line, alternated A B B A (tools/start_bench.py)")
    s.add_argument("--run-config", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--repeats", type=int, default=2, help="starts of each path (the first of each is the cold one)")
    s.add_argument("--log-dir", help="the engines' logs (default: OUT's stem + .logs beside it)")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=_start_bench)

    s = sub.add_parser("targets", help="each committed study's configurations against the speed targets "
                       "(workflow/report/targets.yaml): met, missed or not settled, from their 95%% intervals")
    s.add_argument("--reference", default="results/reference", help="the folder of committed studies")
    s.add_argument("--targets", default=str(Path("workflow") / "report" / "targets.yaml"))
    s.set_defaults(fn=_targets)

    s = sub.add_parser("archive", help="pack one study's results, configs, locks and provenance with a sha256 "
                       "manifest")
    s.add_argument("--results", required=True)
    s.add_argument("--extra", nargs="*", default=[])
    s.add_argument("--runs", nargs="*", default=None, help="the study's run ids (default: every run under runs/)")
    s.add_argument("--bench", nargs="*", default=None, metavar="NAME",
                   help="the study's measurements, by name (results/bench/NAME.json|txt and NAME.slurm.json; an "
                        "engine bench's bench-logs-RUN_ID/ comes with its run); default: every file under bench/")
    s.add_argument("--root", default=".", help="repository root: extra files are named relative to it")
    s.add_argument("--out", required=True)
    s.set_defaults(fn=_archive)

    s = sub.add_parser("compact", help="gzip finished runs' per-request records in place, as results/reference "
                       "keeps them (every GPU lease carries the tree under 64 MiB)")
    s.add_argument("runs", nargs="+", help="run directories (runs/<run id>/)")
    s.set_defaults(fn=_compact)

    s = sub.add_parser("verify", help="check an archive against its manifest")
    s.add_argument("archive")
    s.set_defaults(fn=_verify)
    return p


def os_error_line(exc: OSError) -> str:
    """The file and what the system said of it, as command-line tools say it; a full disk also says what is kept."""
    if exc.errno == errno.ENOSPC:
        return (f"disk full while writing {exc.filename or 'a file'}: free space and rerun (files already written are "
                "kept; a run resumes from its last recorded step)")
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    # raised with a message of hybridrl's own (FileNotFoundError(path), or a sentence): say what kind it is
    return f"not found: {exc}" if isinstance(exc, FileNotFoundError) else str(exc)


_library_warning = warnings.formatwarning


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      line: str | None = None) -> str:
    """hybridrl's own warnings in one line, as its errors are; other libraries' as Python prints them."""
    if "/hybridrl/" in filename:
        return f"hybridrl: warning: {message}\n"
    return _library_warning(message, category, filename, lineno, line)


def main(argv: list[str] | None = None) -> int:
    warnings.formatwarning = _one_line_warning
    args = parser().parse_args(argv)
    try:
        args.fn(args)
    except ConfigError as exc:
        print(f"hybridrl: config error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a missing input, an output that cannot be written, a full disk: one line each
        print(f"hybridrl: {os_error_line(exc)}", file=sys.stderr)
        return 3 if exc.errno == errno.ENOSPC else 2
    except RuntimeError as exc:  # EngineError, RunFailed, download failures: one message, no traceback
        print(f"hybridrl: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0
