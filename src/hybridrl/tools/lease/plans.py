"""The plans: which runs, benchmarks, fault runs and trainer tools a lease runs, in which phases and on which GPUs.

Each `plan_NAME` returns the plan NAME; its docstring says why it exists and what it measures (docs/gpu.md has the
table of plans and what became of each lease). See plan.py for what phases, lanes and items mean. An item is one
of: "train NAME [GPUS]", "bench NAME STEP [ARGS]", "fault NAME KILL_STEP TERM_STEP", "ceiling",
"tbench|tprof SHAPE TRAINER MICRO_BATCH [FLAG...]" (items.py). `HYBRIDRL_DRY_RUN=1 scripts/gpu/run_reference.sh all
PLAN` prints what a plan runs, in order.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Callable

from hybridrl.tools.lease.plan import Plan, interleave, lane, one_lane, replica, tool_rounds

_PLANS: dict[str, Callable[[], Plan]] = {}

# benchmarks that a plan compares across engines get 5 repeats (python -m hybridrl bench's default here is 3)
BENCH_REPEATS_5 = {"HYBRIDRL_BENCH_REPEATS": "5"}


def _plan(build: Callable[[], Plan]) -> Callable[[], Plan]:
    """Registers plan_NAME as plan NAME, its docstring as the plan's description."""
    name = build.__name__.removeprefix("plan_")

    def named() -> Plan:
        return dataclasses.replace(build(), name=name, description=inspect.cleandoc(build.__doc__ or ""))

    _PLANS[name] = named
    return named


class UnknownPlan(KeyError):
    pass


class BadPlanSetting(ValueError):
    """An environment setting a plan reads (HYBRIDRL_ROUND) that it cannot take."""


def env_round() -> int:
    """The round HYBRIDRL_ROUND names (default 1): replicate K of every arm."""
    text = os.environ.get("HYBRIDRL_ROUND") or "1"
    if not text.isdigit() or int(text) < 1:
        raise BadPlanSetting(f"HYBRIDRL_ROUND={text!r}: expected a round number, 1 or more")
    return int(text)


def known_plans() -> list[str]:
    return sorted(_PLANS)


def load_plan(name: str) -> Plan:
    """The plan NAME (placement reads HYBRIDRL_ROUND from the environment); UnknownPlan if there is none."""
    if name not in _PLANS:
        raise UnknownPlan(name)
    return _PLANS[name]()


# -- gpu-h200: the dense study on two or four GPUs -------------------------------------------------------------------

@_plan
def plan_full() -> Plan:
    """The split pair first, side by side with their GPUs crossed so that no GPU holds two engines (the engine
    takes the last visible GPU, the trainer cuda:0); it also fills the compile caches. Then per GPU the colocate,
    restart and Megatron runs and a benchmark, then TP 2."""
    return Plan(phases=(
        (lane("0,1", "train sglang-split"), lane("1,0", "train vllm-split")),
        (lane("0", "train sglang-colocate", "train sglang-restart", "train vllm-inprocess-restart",
              "train sglang-colocate-megatron", "bench sglang-colocate 3 --set sglang_release=all"),
         lane("1", "train vllm-colocate", "train vllm-inprocess-colocate", "train vllm-restart",
              "train vllm-colocate-megatron", "bench vllm-colocate 3")),
        (lane("0,1", "train sglang-colocate-megatron-tp2", "train vllm-colocate-megatron-tp2"),),
    ))


@_plan
def plan_rest() -> Plan:
    """After the first lease (5 of 8 HF runs): the restart runs, Megatron in the loop, the vLLM server again with
    the adapter-reload fix, the standalone benchmarks, then TP 2."""
    return Plan(phases=(
        (lane("0", "train sglang-restart", "train vllm-inprocess-restart", "train sglang-colocate-megatron",
              "bench sglang-colocate-megatron 3 --set sglang_release=all"),
         lane("1", "train vllm-restart", "train vllm-colocate-megatron", "train vllm-colocate",
              "bench vllm-colocate 3")),
        (lane("0,1", "train sglang-colocate-megatron-tp2", "train vllm-colocate-megatron-tp2",
              "train vllm-split 1,0"),),
    ))


@_plan
def plan_rest4() -> Plan:
    """`rest` on four GPUs: the three restart runs (5-8 min each) get a GPU each, the shorter runs share the fourth;
    then the two-GPU runs on two pairs."""
    return Plan(gpus=4, phases=(
        (lane("0", "train sglang-restart"), lane("1", "train vllm-restart"),
         lane("2", "train vllm-inprocess-restart", "train vllm-colocate", "bench vllm-colocate 3"),
         lane("3", "train vllm-colocate-megatron", "train sglang-colocate-megatron",
              "bench sglang-colocate-megatron 3 --set sglang_release=all")),
        (lane("0,1", "train sglang-colocate-megatron-tp2", "train vllm-split"),
         lane("2,3", "train vllm-colocate-megatron-tp2")),
    ))


# -- the MoE studies ------------------------------------------------------------------------------------------------

@_plan
def plan_moe() -> Plan:
    """config/gpu-2xh200-moe.yaml (issue 6 scaled to two GPUs): colocate in two lanes, then the split runs one at a
    time, each with its engine on GPU 1 and its Megatron trainer on GPU 0."""
    return Plan(study="config/gpu-2xh200-moe.yaml", phases=(
        (lane("0", "train sglang-colocate-megatron", "train vllm-inprocess-colocate-megatron"),
         lane("1", "train vllm-colocate-megatron")),
        (lane("0,1", "train sglang-split-megatron", "train vllm-split-megatron",
              "train vllm-inprocess-split-megatron"),),
    ))


@_plan
def plan_moe4() -> Plan:
    """The MoE study on four GPUs, one run a lane, so that every run meets the others of its phase at the start
    barrier: the three colocate runs side by side, then the split pair, then in-process split."""
    return Plan(study="config/gpu-2xh200-moe.yaml", gpus=4, phases=(
        (lane("0", "train sglang-colocate-megatron"), lane("1", "train vllm-colocate-megatron"),
         lane("2", "train vllm-inprocess-colocate-megatron")),
        (lane("0,1", "train sglang-split-megatron"), lane("2,3", "train vllm-split-megatron")),
        (lane("0,1", "train vllm-inprocess-split-megatron"),),
    ))


def moe_pair_lane(*items: str) -> Plan:
    """A plan of the 48-layer study on two GPUs: one lane holding both, its runs one at a time."""
    return Plan(study="config/gpu-4xh200-moe.yaml", phases=((lane("0,1", *items),),))


@_plan
def plan_moe2full() -> Plan:
    """The 48-layer study on a two-GPU machine: only colocate fits (split needs two GPUs for each side), one run at a
    time, those with the fewest committed steps first: on 2026-11-23 vLLM server ran 10 steps, in-process vLLM 7;
    SGLang has 7 from the 4-GPU lease of 2026-11-22."""
    return moe_pair_lane("train sglang-colocate-megatron", "train vllm-inprocess-colocate-megatron",
                         "train vllm-colocate-megatron")


@_plan
def plan_moe2new() -> Plan:
    """Issue 15's 48-layer colocate rerun with the trainer of 2026-11-24 on (grouped-GEMM experts, packed
    micro-batches of 16): moe2full's layout (engines at TP 2 on both GPUs, Megatron TP 1 on the first), SGLang then
    the vLLM server, one run at a time; SGLang first, so that a lease cut short still holds one whole run."""
    return moe_pair_lane("train sglang-colocate-megatron", "train vllm-colocate-megatron")


@_plan
def plan_moe2keep() -> Plan:
    """moe2new's pair with the trainer's frozen base kept on the first GPU (keep_base_on_gpu): each step's update
    starts without moving 57 GiB of weights back from pinned CPU memory (1.2 s of a 6-8 s step in moe2new). SGLang,
    then the vLLM server, one run at a time. Needs the `sglang`, `vllm` and `trainer` overlays."""
    return moe_pair_lane("train sglang-colocate-megatron-keep", "train vllm-colocate-megatron-keep")


@_plan
def plan_moe1full() -> Plan:
    """Issue 15's 48-layer colocate run on one H200 (config/gpu-h200-moefull.yaml: the engine at TP 1, the trainer's
    base kept on the GPU, SGLang releasing its weights to a CPU copy): Megatron, then HF. Needs the `sglang` and
    `trainer` overlays (the 61 GB checkpoint fits the 64 GiB disk beside them)."""
    return one_lane("train sglang-colocate-megatron", "train sglang-colocate", study="config/gpu-h200-moefull.yaml")


@_plan
def plan_moe1vllm() -> Plan:
    """The vLLM server in moe1full's layout (sleep level 1: its weights to CPU memory, as SGLang's full release),
    then SGLang's second replicate beside it in the same lease. Needs the `sglang`, `vllm` and `trainer` overlays."""
    return one_lane("train vllm-colocate-megatron", "train sglang-colocate-megatron-r2",
                    study="config/gpu-h200-moefull.yaml")


@_plan
def plan_moe1pin() -> Plan:
    """moe1full's engine pair again, SGLang's full release now keeping its pinned CPU copy of the weights between
    sleeps (sglang_retain_cpu_backup), as the vLLM server's level 1 keeps its pinned buffers: SGLang, vLLM, SGLang's
    second replicate, one lease. Needs the `sglang`, `vllm` and `trainer` overlays."""
    return one_lane("train sglang-colocate-megatron", "train vllm-colocate-megatron",
                    "train sglang-colocate-megatron-r2", study="config/gpu-h200-moefull.yaml")


@_plan
def plan_moe1pin2() -> Plan:
    """moe1pin's second replicates, in a later lease on another machine: SGLang's (moe1pin's was cut by the
    30-minute hold), then the vLLM server's, so that the 48-layer pair has two runs a side over two leases
    (interleaved: S V in moe1pin, S V here). Needs the `sglang`, `vllm` and `trainer` overlays."""
    return one_lane("train sglang-colocate-megatron-r2", "train vllm-colocate-megatron-r2",
                    study="config/gpu-h200-moefull.yaml")


@_plan
def plan_moe4full() -> Plan:
    """config/gpu-4xh200-moe.yaml (issue 6 at the write-up's shape, engines at TP 2; about 15 min a run): the
    colocate pair side by side on the two GPU pairs, then split on all four, then in-process vLLM."""
    return Plan(study="config/gpu-4xh200-moe.yaml", gpus=4, phases=(
        (lane("0,1", "train sglang-colocate-megatron"), lane("2,3", "train vllm-colocate-megatron")),
        (lane("0,1,2,3", "train sglang-split-megatron", "train vllm-split-megatron",
              "train vllm-inprocess-colocate-megatron 0,1", "train vllm-inprocess-split-megatron"),),
    ))


# -- issue 20: the rollout client --------------------------------------------------------------------------------

@_plan
def plan_client() -> Plan:
    """Issue 20 on one GPU: the client's ceiling on this host, then per HTTP engine the new-path colocate run and the
    benchmark of its paths (raw, new, whole, stream-everything, old) on its step 3, then their old-path runs (the
    HTTP client is what the issue measures, so a lease that ends early keeps those pairs), then in-process vLLM."""
    return one_lane("ceiling", "train sglang-new", "bench sglang-new 3", "train vllm-new", "bench vllm-new 3",
                    "train sglang-old", "train vllm-old", "train vllm-inprocess-new", "bench vllm-inprocess-new 3",
                    "train vllm-inprocess-old", study="config/gpu-h200-client.yaml", env=BENCH_REPEATS_5)


@_plan
def plan_timed() -> Plan:
    """Issue 20's next step on one GPU: per engine the dense colocate run with nothing streamed and the engine timing
    every request itself (engine_timing), then `bench` on its step 3: raw, that path, and every request streamed (the
    client's own TTFT and TPOT beside the engine's, on one engine start and request set); about 15 minutes."""
    paths = "--paths raw client stream_all"
    return one_lane(*(x for e in ("sglang", "vllm", "vllm-inprocess")
                      for x in (f"train {e}-timed", f"bench {e}-timed 3 {paths}")),
                    study="config/gpu-h200-client.yaml", env=BENCH_REPEATS_5)


# -- issue 19: soak and faults -------------------------------------------------------------------------------------

@_plan
def plan_soak() -> Plan:
    """Issue 19 on one GPU: 50 colocate steps per engine, the asleep-memory gate on; about 10 minutes a run."""
    return one_lane("train sglang-soak", "train vllm-soak", "train vllm-inprocess-soak",
                    study="config/gpu-h200-soak.yaml")


@_plan
def plan_faults() -> Plan:
    """Issue 19's fault runs on one GPU: per engine, its engine killed in step 2's rollout and SIGTERM in step 4's
    training (then resumed); a few minutes a run, so it fits beside part of `soak` in a lease."""
    return one_lane("fault sglang-fault 2 4", "fault vllm-fault 2 4", "fault vllm-inprocess-fault 2 4",
                    study="config/gpu-h200-soak.yaml")


# -- issue 17: learning --------------------------------------------------------------------------------------------

@_plan
def plan_learning() -> Plan:
    """Issue 17 on one GPU (config/gpu-h200-learning.yaml; prepare warm-starts the model): 30 steps per engine first
    (what the issue needs most), then the vocabulary measurement (short, rollout only, the two vocabularies side by
    side per engine)."""
    return one_lane("train sglang-colocate", "train vllm-colocate", "train sglang-vocab-small",
                    "train sglang-vocab-qwen", "train vllm-vocab-small", "train vllm-vocab-qwen",
                    study="config/gpu-h200-learning.yaml")


@_plan
def plan_vocabbench() -> Plan:
    """Issue 17, item 6, as the issue asks it: each engine's standalone benchmark (5 repeats, raw: nothing streamed, no
    client of ours) on the same prompts at the 0.6B shape with a small vocabulary and with Qwen's 151,936 rows. The
    learning lease measured it through the loop only, 3 steps of one run each. Per engine and vocabulary a short
    rollout-only run (its step-3 request set), then the benchmark on it. Needs the `sglang` and `vllm` overlays;
    about 20 minutes."""
    items = []
    for engine in ("sglang", "vllm"):
        for vocab in ("small", "qwen"):
            items += [f"train {engine}-vocab-{vocab}", f"bench {engine}-vocab-{vocab} 3 --paths raw"]
    return one_lane(*items, study="config/gpu-h200-learning.yaml", env=BENCH_REPEATS_5)


@_plan
def plan_learnlr() -> Plan:
    """Issue 17's open question on one GPU (config/gpu-h200-learning.yaml): 50 warm-started steps per engine at ten
    times `learning`'s learning rate (1e-3), eval every 5 steps, SGLang then the vLLM server."""
    return one_lane("train sglang-learn", "train vllm-learn", study="config/gpu-h200-learning.yaml")


@_plan
def plan_learnentropy() -> Plan:
    """learnlr's reading put to a measurement: with train/entropy in every step, SGLang's 50 steps at lr 1e-3, then
    its 30 at learning's lr 1e-4 as the control (learnlr's run id; the control's id has changed since learning's
    lease, its seed and prompts have not). Does the policy's entropy fall faster at the higher rate, as a policy
    sharpening toward its greedy answers would? Then the HF trainer's dense benchmark and profiled update: the
    profile's rows by input shape hold the entropy's own ops on [.., vocab] chunks (it has no off switch to time
    against). Needs `sglang`."""
    return one_lane("train sglang-learn", "train sglang-colocate", "tbench qwen3-0.6b hf 32",
                    "tprof qwen3-0.6b hf 32", study="config/gpu-h200-learning.yaml")


@_plan
def plan_hffused() -> Plan:
    """Issue 15's HF dense target after the adapters' outputs moved inside their B matmul
    (hf_fast.fuse_lora_outputs): PEFT's forward (peft-lora) and the fused one in one lease, fixed then varied
    lengths, Megatron's dense row beside them, the fused update profiled; then learnentropy's owed lr 1e-4 control
    (learning's sglang-colocate, entropy recorded, the fused HF trainer gated against SGLang's logprobs). Needs
    `sglang` and `trainer`."""
    return one_lane("tbench qwen3-0.6b hf 32 peft-lora", "tbench qwen3-0.6b hf 32", "tbench qwen3-0.6b megatron 32",
                    "tbench qwen3-0.6b hf 32 varied peft-lora", "tbench qwen3-0.6b hf 32 varied",
                    "tprof qwen3-0.6b hf 32", "train sglang-colocate", study="config/gpu-h200-learning.yaml")


@_plan
def plan_verdictwarm() -> Plan:
    """Issue 16's headline pair on issue 17's model (config/gpu-h200-learning.yaml; prepare warm-starts it):
    SGLang's full release (pinned copy kept) and the vLLM server at level 1, three replicates each, interleaved,
    10 steps a run, rollouts stopping at EOS; no benchmarks."""
    return one_lane(interleave(3, "sglang-verdict", "vllm-verdict"), study="config/gpu-h200-learning.yaml")


@_plan
def plan_verdictwarmkv() -> Plan:
    """Issue 16's other two arms on issue 17's model (config/gpu-h200-learning.yaml; prepare warm-starts it): SGLang's
    KV-only release and in-process vLLM at level 1, three replicates each, interleaved, 10 steps a run; then each
    engine's standalone benchmark (5 repeats, raw against the run's client) on step 3's request set of its run, SGLang
    KV-only's first. Its comparisons with `verdictwarm`'s arms span leases, which the report's caveats say."""
    vpaths = "--paths raw client"
    return one_lane(interleave(3, "sglang-verdict-kv", "vllm-inprocess-verdict"), f"bench sglang-verdict-kv 3 {vpaths}",
                    f"bench vllm-inprocess-verdict 3 {vpaths}", study="config/gpu-h200-learning.yaml",
                    env=BENCH_REPEATS_5)


@_plan
def plan_verdictvllm() -> Plan:
    """Issue 16, in-process vLLM against the vLLM server in one lease (both level 1, the same bytes moved) on issue
    17's model, three replicates each, interleaved, 10 steps a run. verdictwarmkv (2026-11-27) put in-process vLLM's
    rollout 1.49x the server's of two earlier leases, while the HF update, which no engine touches, also ran 0.84x
    there (other code, another machine). The three release-everything arms do not fit one lease (about 31 minutes
    with the warm start, from the leases' run times), so each pair gets its own: this, verdictinproc and
    verdictwarm. Then the vLLM server's standalone benchmark on this model (5 repeats, raw against the run's client),
    which no lease has run yet; a lease cut before it keeps the runs."""
    return one_lane(interleave(3, "vllm-inprocess-verdict", "vllm-verdict"),
                    "bench vllm-verdict 3 --paths raw client", study="config/gpu-h200-learning.yaml",
                    env=BENCH_REPEATS_5)


@_plan
def plan_verdictvllmtimed() -> Plan:
    """Where the vLLM server's rollout loses to in-process vLLM: verdictvllm (2026-11-27) put the server's time to
    the first token at 2.6x in-process's with the same engine core and the same per-token pace. Both arms again
    with the engines timing every request themselves (engine_timing: arrival at the engine to its first token,
    beside the client's TTFT), three replicates each, interleaved with the order reversed in the second round (in
    verdictvllm in-process vLLM always ran first), so the HTTP front end's share of that gap is measured, not
    inferred. Needs the `sglang` (the warm start's prepare) and `vllm` overlays; about 25 minutes."""
    return one_lane(interleave(3, "vllm-inprocess-verdict-timed", "vllm-verdict-timed", balanced=True),
                    study="config/gpu-h200-learning.yaml")


@_plan
def plan_verdictinproc() -> Plan:
    """Issue 16, SGLang's full release (pinned copy kept) against in-process vLLM at level 1 in one lease on issue
    17's model, three replicates each, interleaved, 10 steps a run: the third same-lease pair of the
    release-everything arms, beside verdictwarm (SGLang against the vLLM server) and verdictvllm. The second round
    runs in-process vLLM first: every verdict lease so far ran the same arm first in every round."""
    return one_lane(interleave(3, "sglang-verdict", "vllm-inprocess-verdict", balanced=True),
                    study="config/gpu-h200-learning.yaml")


@_plan
def plan_verdictsglang() -> Plan:
    """Issue 16: SGLang's two release policies in one lease on issue 17's model, full release (pinned copy kept)
    against KV-only (weights stay on the GPU), three replicates each, interleaved with the order reversed in the
    second round, 10 steps a run. The two arms were recorded in different leases so far (verdictwarm, verdictwarmkv),
    so what releasing the weights costs SGLang's sleep, wake and step rests on runs of two machines. Needs the
    `sglang` overlay alone; about 20 minutes held."""
    return one_lane(interleave(3, "sglang-verdict", "sglang-verdict-kv", balanced=True),
                    study="config/gpu-h200-learning.yaml")


@_plan
def plan_verdictdraws() -> Plan:
    """Issue 16's headline pair on issue 17's model with a draw of answers per replicate (replicate_seeds): SGLang's
    full release (pinned copy kept) and the vLLM server at level 1, three replicates each, interleaved, 10 steps a
    run. In verdictwarm the vLLM server's replicates answered every request at the same length (it honours the
    per-request seeds) while SGLang's drifted apart, so its interval over runs held timing only; here replicate k of
    both arms has seeds of its own and the intervals hold the spread of the answers for both. Needs the `sglang`
    and `vllm` overlays; about 25 minutes held, as verdictwarm."""
    return one_lane(interleave(3, "sglang-verdict-draws", "vllm-verdict-draws"),
                    study="config/gpu-h200-learning.yaml")


# -- issue 15: the trainers (bench/trainer-<shape>... in the default study's folder) -----------------------------

@_plan
def plan_trainer() -> Plan:
    """Issue 15 on one GPU: the trainer benchmark, HF and Megatron TP 1 on a fixed batch, 5 updates after a warm-up,
    one trainer a process (both in one held the 30B checkpoint twice over: killed by the host): the dense 0.6B shape
    (128 x 256) at 32 samples a pass, then the 48-layer Qwen3-30B-A3B shape (64 x 256) at 16, the most that fits
    (2026-11-24)."""
    return one_lane("tbench qwen3-0.6b hf 32", "tbench qwen3-0.6b megatron 32", "tbench qwen3-30b-a3b hf 16",
                    "tbench qwen3-30b-a3b megatron 16")


@_plan
def plan_packing() -> Plan:
    """Issue 15, packed sequences: per shape both trainers packed (the default now) and padded (--no-pack) on
    completions of varied length, then packed on the fixed lengths of `trainer`'s rows; one update of each trainer
    on the dense shape under torch.profiler (Megatron's gap to HF); the 48-layer shape last (its model build takes
    minutes)."""
    return one_lane("tbench qwen3-0.6b hf 32 varied", "tbench qwen3-0.6b megatron 32 varied",
                    "tbench qwen3-0.6b hf 32 varied no-pack", "tbench qwen3-0.6b megatron 32 varied no-pack",
                    "tbench qwen3-0.6b hf 32", "tbench qwen3-0.6b megatron 32", "tprof qwen3-0.6b hf 32",
                    "tprof qwen3-0.6b megatron 32", "tbench qwen3-30b-a3b hf 16 varied",
                    "tbench qwen3-30b-a3b megatron 16 varied", "tbench qwen3-30b-a3b hf 16 varied no-pack",
                    "tbench qwen3-30b-a3b megatron 16 varied no-pack", "tbench qwen3-30b-a3b megatron 16")


@_plan
def plan_trainerloop() -> Plan:
    """Issue 15 after the Megatron LoRA's matmuls moved to the activations' dtype: Megatron TP 1 packed on both
    shapes (fixed lengths; dense also varied) with HF dense beside it in the same lease, its profiled update, a dense
    SGLang colocate run with the Megatron trainer (packed, in the loop, its logprob gap gated against the engine)."""
    return one_lane("tbench qwen3-0.6b megatron 32", "tbench qwen3-0.6b hf 32", "tbench qwen3-0.6b megatron 32 varied",
                    "tprof qwen3-0.6b megatron 32", "train sglang-colocate-megatron",
                    "tbench qwen3-30b-a3b megatron 16")


@_plan
def plan_trainermoe() -> Plan:
    """The 48-layer row that `trainerloop` lost to a full disk: Megatron TP 1 then HF on the MoE shape, packed, fixed
    lengths, in a lease with only the `trainer` overlay (the 61 GB checkpoint fits the 64 GiB disk beside it)."""
    return one_lane("tbench qwen3-30b-a3b megatron 16", "tbench qwen3-30b-a3b hf 16")


@_plan
def plan_trainerfuse() -> Plan:
    """Issue 15 after the trainers' launch cuts (Megatron: one LoRA site per base linear, RoPE tables once per
    forward, norms in the model's dtype; HF: no fp32 copy of each adapter input): Megatron TP 1 and HF on the dense
    shape in one lease, fixed and varied lengths, both profiled, then a dense SGLang colocate run with the Megatron
    trainer (its logprobs gated against the engine's). The 48-layer rows are `trainermoe` (their 61 GB checkpoint and
    the SGLang overlay do not share the disk)."""
    return one_lane("tbench qwen3-0.6b megatron 32", "tbench qwen3-0.6b hf 32", "tbench qwen3-0.6b megatron 32 varied",
                    "tbench qwen3-0.6b hf 32 varied", "tprof qwen3-0.6b megatron 32", "tprof qwen3-0.6b hf 32",
                    "train sglang-colocate-megatron")


@_plan
def plan_trainerfast() -> Plan:
    """Issue 15 after HF's norms went through torch's fused kernel: both trainers on both shapes in one lease with
    only the `trainer` overlay (dense fixed and varied lengths, HF's update profiled, then the 48-layer rows)."""
    return one_lane("tbench qwen3-0.6b megatron 32", "tbench qwen3-0.6b hf 32", "tbench qwen3-0.6b megatron 32 varied",
                    "tbench qwen3-0.6b hf 32 varied", "tprof qwen3-0.6b hf 32", "tbench qwen3-30b-a3b megatron 16",
                    "tbench qwen3-30b-a3b hf 16")


@_plan
def plan_hfrounds() -> Plan:
    """Issue 15's dense rows in four interleaved rounds of one lease: the update is bound by the host's launches and
    its median moved by tens of percent between processes of one configuration
    (results/reference/2026-11-25-h200-hffused), so each configuration gets four processes: HF with PEFT's adapter
    forward and the fused one at 32 samples a micro-batch, HF at 64, Megatron TP 1 at 32 and 64. Needs only the
    `trainer` overlay."""
    return one_lane(tool_rounds(4, "tbench qwen3-0.6b hf 32 peft-lora", "tbench qwen3-0.6b hf 32",
                                "tbench qwen3-0.6b hf 64", "tbench qwen3-0.6b megatron 32",
                                "tbench qwen3-0.6b megatron 64"))


@_plan
def plan_trainervocab() -> Plan:
    """Issue 15's trainer rows at Qwen3's vocabulary: every committed trainer-bench row ran the shapes with 768
    output rows, while the study models have had Qwen's 151,936 since issue 17, whose output head and log-softmax
    the update then also computes. Three interleaved rounds of the dense shape, both trainers at 32 samples a
    micro-batch, at 768 and at 151,936 rows; then the 48-layer shape's Megatron TP 1 row at 151,936 (16 a
    micro-batch). Needs only the `trainer` overlay."""
    return one_lane(tool_rounds(3, "tbench qwen3-0.6b hf 32", "tbench qwen3-0.6b hf 32 vocab=151936",
                                "tbench qwen3-0.6b megatron 32", "tbench qwen3-0.6b megatron 32 vocab=151936",
                                balanced=True),
                    "tbench qwen3-30b-a3b megatron 16 vocab=151936")


@_plan
def plan_moerounds() -> Plan:
    """Issue 15's 48-layer rows (Qwen3-30B-A3B shape, 64 x 256, 16 samples a micro-batch, packed) as three
    interleaved rounds of Megatron TP 1 then HF, one process each: the target (at most 1.9 s an update) was met by
    single processes at 1.82 and 1.88 s, within the noise `hffused` showed between processes. Only the `trainer`
    overlay (the 61 GB checkpoint needs the disk)."""
    return one_lane(tool_rounds(3, "tbench qwen3-30b-a3b megatron 16", "tbench qwen3-30b-a3b hf 16"))


@_plan
def plan_moepermute() -> Plan:
    """Issue 15's 48-layer update after the MoE token permutation became gathers (trainers/megatron/dispatch.py):
    three rounds of a Megatron TP 1 benchmark process with megatron's own permutation then one with the gathers (the
    wall time, judged over processes on one host), then one profiled update of each (GPU kernel time: the wall time
    is partly host-bound). Only the `trainer` overlay."""
    return one_lane(tool_rounds(3, "tbench qwen3-30b-a3b megatron 16 megatron-permute",
                                "tbench qwen3-30b-a3b megatron 16"),
                    "tprof qwen3-30b-a3b megatron 16 megatron-permute", "tprof qwen3-30b-a3b megatron 16")


# Source snapshots (src-REV; scripts/gpu/snapshot-src.sh REV makes .gpu/src-REV, carried with the call): the commit
# before a change measured beside the tree in one lease.

@_plan
def plan_syncfree() -> Plan:
    """Issue 15 after the GRPO step stopped waiting for the GPU between micro-batches (trainers/grpo.py: every
    micro-batch copied first, the readings summed on the device and read once): the commit before (src-ec2b5bd) and
    the tree, interleaved in one lease. The 48-layer Megatron TP 1 update first (three rounds), then both dense
    trainers (three rounds), then one profiled update of each shape's fastest trainer with the host's remaining waits
    listed. Only the `trainer` overlay."""
    return one_lane(tool_rounds(3, "tbench qwen3-30b-a3b megatron 16 src-ec2b5bd", "tbench qwen3-30b-a3b megatron 16"),
                    tool_rounds(3, "tbench qwen3-0.6b hf 32 src-ec2b5bd", "tbench qwen3-0.6b hf 32",
                                "tbench qwen3-0.6b megatron 32 src-ec2b5bd", "tbench qwen3-0.6b megatron 32"),
                    "tprof qwen3-30b-a3b megatron 16", "tprof qwen3-0.6b megatron 32", "tprof qwen3-0.6b hf 32")


@_plan
def plan_syncfree2() -> Plan:
    """syncfree again, its 48-layer rows interleaved from the first round (in syncfree the first copy of the code
    lacked the snapshot, so the commit before ran rounds 1-3 after the change's rounds 1-2): four rounds of the
    48-layer Megatron TP 1 update from the commit before (src-ec2b5bd) and from the tree, then three of the dense HF
    update, whose ratio syncfree also left open. Only the `trainer` overlay; about 24 minutes."""
    return one_lane(tool_rounds(4, "tbench qwen3-30b-a3b megatron 16 src-ec2b5bd", "tbench qwen3-30b-a3b megatron 16"),
                    tool_rounds(3, "tbench qwen3-0.6b hf 32 src-ec2b5bd", "tbench qwen3-0.6b hf 32"))


@_plan
def plan_hfexport() -> Plan:
    """The HF trainer's adapter export written by hybridrl (trainers/adapter_files.py: one copy to the host per
    dtype, no model card) instead of PEFT's save_pretrained, against the commit before (src-c931dfb): the dense HF
    update, export included, in five interleaved rounds (syncfree's HF export took 0.16-0.24 s of a 1.0-1.2 s
    update). Only the `trainer` overlay; about 8 minutes."""
    return one_lane(tool_rounds(5, "tbench qwen3-0.6b hf 32 src-c931dfb", "tbench qwen3-0.6b hf 32"))


@_plan
def plan_exportviews() -> Plan:
    """Both trainers' adapter export after the optimizer's moments became views of one host copy (one torch.save
    record instead of one a tensor) and the HF trainer stopped walking PEFT's whole state dict each save, against
    38fe1e5 (hfexport's tree; snapshot-src.sh 38fe1e5): the dense HF update in five interleaved rounds, then the
    48-layer Megatron TP 1 update in three (its export was 0.10-0.19 s of an update). Only the `trainer` overlay;
    about 20 minutes."""
    return one_lane(tool_rounds(5, "tbench qwen3-0.6b hf 32 src-38fe1e5", "tbench qwen3-0.6b hf 32"),
                    tool_rounds(3, "tbench qwen3-30b-a3b megatron 16 src-38fe1e5", "tbench qwen3-30b-a3b megatron 16"))


@_plan
def plan_asyncstate() -> Plan:
    """The optimizer state written on a thread after the update (trainers/adapter_files.StateWriter; the update ends
    once the engine's files are written) against the commit before (src-5173bee), and exportviews' question, that
    commit against 38fe1e5: the dense HF update in four interleaved rounds of the three, then the 48-layer Megatron
    TP 1 update in three rounds of the commit before and the tree. Only the `trainer` overlay; about 20 minutes."""
    return one_lane(tool_rounds(4, "tbench qwen3-0.6b hf 32 src-38fe1e5", "tbench qwen3-0.6b hf 32 src-5173bee",
                                "tbench qwen3-0.6b hf 32"),
                    tool_rounds(3, "tbench qwen3-30b-a3b megatron 16 src-5173bee", "tbench qwen3-30b-a3b megatron 16"))


@_plan
def plan_exportstage() -> Plan:
    """The adapter export through reused pinned host buffers (adapter_files.HostStaging) with the B norm as one fused
    norm on the device, against the commit before (src-5bf06b5): exportprofile's 48-layer profile had the export's
    three copies to fresh pageable memory take 55 ms of GPU time and the norm 30 ms. Three interleaved rounds of the
    dense HF update, then two of the 48-layer Megatron TP 1 update. Only the `trainer` overlay; about 13 minutes."""
    return one_lane(tool_rounds(3, "tbench qwen3-0.6b hf 32 src-5bf06b5", "tbench qwen3-0.6b hf 32"),
                    tool_rounds(2, "tbench qwen3-30b-a3b megatron 16 src-5bf06b5", "tbench qwen3-30b-a3b megatron 16"))


# -- issue 16: the engine verdict (config/gpu-h200-verdict.yaml) --------------------------------------------------

@_plan
def plan_verdict() -> Plan:
    """Issue 16 on one GPU, first lease: the headline pair, SGLang and the vLLM server, each releasing weights and KV
    cache, three replicates each, interleaved round by round, one run at a time with nothing else on the host; then
    each engine's standalone benchmark, 5 repeats, on step 3's request set (the same in every replicate), raw against
    the run's client only (the client lease measured the other paths); the client's ceiling last. Two arms, not
    three: with each engine's first start on a bare host, three arms x three rounds take about 30 minutes before any
    benchmark, more than a lease holds."""
    vpaths = "--paths raw client"
    return one_lane(interleave(3, "sglang-full", "vllm-server"), f"bench sglang-full 3 {vpaths}",
                    f"bench vllm-server 3 {vpaths}", "ceiling", study="config/gpu-h200-verdict.yaml",
                    env=BENCH_REPEATS_5)


@_plan
def plan_verdictkv() -> Plan:
    """Issue 16, second lease: in-process vLLM (level 1) and SGLang's KV-only release, an arm of its own (its sleep
    and wake move other bytes than any other arm's), three replicates each, interleaved, then their benchmarks; their
    comparisons with the first lease's arms span two leases, which the report's caveats say."""
    vpaths = "--paths raw client"
    return one_lane(interleave(3, "vllm-inprocess", "sglang-kv"), f"bench vllm-inprocess 3 {vpaths}",
                    f"bench sglang-kv 3 {vpaths}", study="config/gpu-h200-verdict.yaml", env=BENCH_REPEATS_5)


@_plan
def plan_verdictpin() -> Plan:
    """The headline pair again, SGLang's full release now keeping its pinned CPU copy of the weights from one sleep to
    the next (sglang_retain_cpu_backup), as vLLM's level 1 keeps its pinned buffers; `verdict` ran SGLang re-pinning
    the copy every sleep. Three replicates each, interleaved; no benchmarks (the runs' client was measured in
    `verdict`)."""
    return one_lane(interleave(3, "sglang-full", "vllm-server"), study="config/gpu-h200-verdict.yaml")


@_plan
def plan_timingcost() -> Plan:
    """Issue 20's open question on one GPU (config/gpu-h200-verdict.yaml): SGLang with nothing streamed, its own
    request timing off and on (engine_timing forces its stream interval to 1), two replicates each, interleaved."""
    return one_lane(interleave(2, "sglang-untimed", "sglang-timed"), study="config/gpu-h200-verdict.yaml")


# -- issue 18: placement ----------------------------------------------------------------------------------------

PLACEMENT_STUDY = "config/gpu-2xh200-placement.yaml"
# the six arms of a round; the engines alternate so that a drift of the host falls on both
PLACEMENT_ARMS = ("sglang-colocate", "vllm-colocate", "sglang-split", "vllm-split", "sglang-overlap", "vllm-overlap")


def placement_round(k: int, arms: tuple[str, ...] = PLACEMENT_ARMS) -> list[str]:
    """Replicate K of the arms, one run at a time: colocate on GPU 0, split and overlap with the engine on GPU 1 and
    the trainer on GPU 0. Rounds 1 and 2 ran the placements in the order given (2026-11-26); round 3 and every odd
    round after it reverse the placements (each engine pair kept together), so that no placement always runs first
    in its lease, where a host's drift would tilt it the same way every round."""
    placements = list(dict.fromkeys(arm.split("-", 1)[1] for arm in arms))
    if k >= 3 and k % 2:
        placements.reverse()
    ordered = sorted(arms, key=lambda arm: placements.index(arm.split("-", 1)[1]))  # stable: engines keep order
    return [f"train {replica(arm, k)}" + (" 0" if arm.endswith("-colocate") else "") for arm in ordered]


def two_gpu_lane(*items: str) -> Plan:
    """A plan of the placement study whose one lane holds both GPUs."""
    return Plan(study=PLACEMENT_STUDY, gpus=2, phases=((lane("0,1", *items),),))


@_plan
def plan_placement() -> Plan:
    """Issue 18 on two GPUs (config/gpu-2xh200-placement.yaml): one round of the six arms, round HYBRIDRL_ROUND
    (default 1; replicate K is ARM-rK). 16 minutes on 2026-11-26, so one lease a round, each holding every comparison
    of its round."""
    return two_gpu_lane(*placement_round(env_round()))


@_plan
def plan_placementrest() -> Plan:
    """What issue 18's study owes after its first lease (2026-11-26): round 2's colocate arms and the vLLM
    server's overlapped run (cut by the budget there), then round 3 whole, one run at a time. A lease that ends
    early keeps whole runs; about 22 minutes of runs with each engine's first start."""
    return two_gpu_lane(*placement_round(2, ("sglang-colocate", "vllm-colocate", "vllm-overlap")), *placement_round(3))


@_plan
def plan_placementlong() -> Plan:
    """Issue 18's drift runs: 30 overlapped steps per engine, one after the other (about 8 minutes each)."""
    return two_gpu_lane("train sglang-overlap-long", "train vllm-overlap-long")


@_plan
def plan_overlapproc() -> Plan:
    """Whether the overlapped runs' slower update (longer than a plain split's, by an interval over three runs
    an arm that excludes 1: results/reference/2026-11-26-2xh200-placement) is the rollout client's thread
    holding the trainer's interpreter lock: per engine, the overlapped arm's replicates 4 and 5 (the client in a
    thread) against the same arm with the client in a worker process (rollout_process), interleaved; about 15
    minutes of runs."""
    pairs = []
    for k in (1, 2):
        for engine in ("sglang", "vllm"):
            pairs += [f"train {replica(f'{engine}-overlap', k + 3)}", f"train {replica(f'{engine}-overlap-proc', k)}"]
    return two_gpu_lane(*pairs)


@_plan
def plan_overlap1() -> Plan:
    """Issue 18's overlapped split on one GPU, shared by engine and trainer (config/gpu-h200-overlap.yaml): a check of
    behaviour before the two-GPU study, no placement figure. Per engine with the HF trainer a run, then a fault run
    (the engine killed while step 3's rollout runs ahead, SIGTERM in step 5's training), then with Megatron TP 1."""
    return one_lane("train sglang-overlap", "train vllm-overlap", "fault sglang-overlap-fault 3 5",
                    "fault vllm-overlap-fault 3 5", "train sglang-overlap-megatron", "train vllm-overlap-megatron",
                    study="config/gpu-h200-overlap.yaml")


@_plan
def plan_placement1() -> Plan:
    """Issue 18's placement question on one GPU (config/gpu-h200-placement1.yaml): per engine, colocate (taking
    turns, everything released) against overlap (both resident, step k+1's rollout beside step k's training), two
    replicates interleaved round by round, one run at a time; about 22 minutes with each engine's first start."""
    return one_lane(interleave(2, "sglang-colocate", "vllm-colocate", "sglang-overlap", "vllm-overlap"),
                    study="config/gpu-h200-placement1.yaml")


@_plan
def plan_placement1v() -> Plan:
    """placement1's third replicate of the vLLM server's pair (colocate, then overlap), in a lease of its own: needs
    only the `vllm` overlay."""
    return one_lane("train vllm-colocate-r3", "train vllm-overlap-r3", study="config/gpu-h200-placement1.yaml")


@_plan
def plan_placement1s() -> Plan:
    """placement1's third replicate of SGLang's pair (colocate, then overlap), in a lease of its own as placement1v
    was for the vLLM server: needs only the `sglang` overlay."""
    return one_lane("train sglang-colocate-r3", "train sglang-overlap-r3", study="config/gpu-h200-placement1.yaml")
