"""The per-step record's keys, defined once: the loop fills them, telemetry times them, the report reads them.

verl's names where one exists. Every record carries every key of RECORD_KEYS (null where a run has no such
value, e.g. no sleep in split), so tables line up; a record may add keys of its own (per-GPU memory, engine
readings), which the report keeps as extra columns.
"""

from __future__ import annotations

from typing import Any

from hybridrl.engines.startup import PARTS, UNEXPLAINED
from hybridrl.run.gc_pauses import KEYS as GC_PAUSES
from hybridrl.run.onload_beside_release import KEYS as ONLOAD_BESIDE

IDENTITY = ("run_id", "engine", "placement", "trainer", "model", "tp", "seed", "step")
# The phases of a step, in the order they happen. Each is timed as timing_s/<phase>, and together they make up
# timing_s/step (a test holds every step but one to 2%, CPU scheduling aside): prepare builds and tokenizes the
# requests, reads the trainer's GPU memory and the run's threads' CPU time around gen; reward includes the
# per-request audit file; release_onload is the engine's release of its weights with the trainer's onload beside it
# (onload_beside_release: the two at once, so neither sleep nor trainer_onload holds them); restart is the engine's
# stop before training plus its start after; save_adapter is timed by the trainer inside its step; await_rollout is
# the wait, after training, for a rollout running ahead (overlap) to end before the new adapter is loaded;
# save_state is the wait, at the step's end, for the optimizer state the trainer writes while the engine takes its
# adapter (a recorded step can be resumed); recover is starting an engine found dead again (errors/engine_restarts
# counts those), and the wait to tell whether an engine whose requests failed is dead.
PHASES = ("prepare", "gen", "reward", "sleep", "release_onload", "trainer_onload", "update_actor", "save_adapter",
          "trainer_offload", "await_rollout", "wake", "restart", "update_weights", "check", "save_state", "recover")
PHASE_KEYS = tuple(f"timing_s/{p}" for p in PHASES)
# The instrument's own phases: the canary probes (base unchanged, adapter applied, KV capacity), which cost engines
# differently and which no production step runs. The step that studies compare leaves them out; timing_s/step
# stays the whole wall-clock step. (The logprob gap needs no phase: it is read from the update's own forward.)
INSTRUMENT_PHASES = ("check",)
COMPARED_STEP = "timing_s/step_compared"
TIMING = (*PHASE_KEYS, "timing_s/step", COMPARED_STEP)
# overlap: seconds of the step in which engine and trainer both worked, and each one's idle time (not phases:
# the overlapped part is counted in both sides' time)
CONCURRENCY = ("timing_s/overlap", "timing_s/engine_idle", "timing_s/trainer_idle")
# A run's first step only (a resumed run's too), not part of the step: the engine's first start; the wait for runs
# beside it (start_barrier: the old lease driver's, in committed studies; none since); the trainer's build before it
# (weights loaded, adapter drawn or resumed); the instrument's measurements of the host before the engine starts
# (the host link's bandwidth, the rollout client's ceiling)
RUN_START = ("timing_s/engine_start", "timing_s/start_barrier", "timing_s/trainer_build", "timing_s/host_measure")
# An engine start's parts (hybridrl.engines.startup; null where its log has no line for one). The run's first start
# beside timing_s/engine_start, on the same step; the starts within a step (restart placement's after training, a
# dead engine's recovery) summed on that step, timing_s/engine_restart their whole time
START_PARTS = (*PARTS, UNEXPLAINED)
ENGINE_START_SPLIT = tuple(f"timing_s/engine_start_{p}" for p in START_PARTS)
ENGINE_RESTART = ("timing_s/engine_restart", *(f"timing_s/engine_restart_{p}" for p in START_PARTS))
# The greedy test pass of every eval_every-th step, after the step: not part of timing_s/step, so that step times
# and rollout figures compare alike with and without it. Accuracy over wall-clock time uses timing_s/step alone.
EVAL = ("eval/accuracy", "eval/problems", "eval/response_length_mean", "eval/stop_ratio", "timing_s/eval")
# Phases whose host CPU load is recorded: a busy host (another run starting beside this one) slows them.
HOST_LOAD_PHASES = ("gen", "update_actor")
# Phases whose controller CPU use is recorded (% of one core, all its threads): a rollout client near 100% of a
# core limits the throughput it measures.
CONTROLLER_CPU_PHASES = ("gen",)
# GPU processes outside this run (not descended from its controller) seen at the step's phase changes: another
# job on the run's GPUs would disturb every figure of the step
# The run's CPU in CONTROLLER_CPU_PHASES: its whole process tree and its busiest thread (% of one core), with that
# thread's "process/thread" name. A thread near 100% either limits the rollout or spins while it waits (SGLang's
# scheduler reads a full core at any load), so compare it between runs of one engine, not between engines.
HOST = (*(f"host/cpu_busy_pct_{p}" for p in HOST_LOAD_PHASES),
        *(f"host/controller_cpu_pct_{p}" for p in CONTROLLER_CPU_PHASES),
        *(f"host/{k}_{p}" for p in CONTROLLER_CPU_PHASES for k in ("run_cpu_pct", "busiest_thread_cpu_pct",
                                                                    "busiest_thread")),
        "host/foreign_gpu_procs",
        # the controller's garbage-collector pauses (hybridrl.run.gc_pauses): in seconds over the step and within its
        # gen phase (every Python thread of the controller waits them out, the rollout client's too), and how many
        # of the step's collections were full ones (generation 2)
        *GC_PAUSES)
# The GPUs during the phases that load them (NVML, sampled at 10 Hz, over the run's GPUs): median SM clock (the
# slowest GPU's), mean power (W) and highest temperature (C) of the hungriest GPU, share of reads in which a GPU
# reported a power or thermal slowdown. A clock held down during one run's rollout and not another's is a
# difference of the GPU, not of the engines.
GPU_LOAD_PHASES = HOST_LOAD_PHASES
GPU = tuple(f"gpu/{k}_{p}" for p in GPU_LOAD_PHASES for k in ("sm_clock_mhz", "power_w", "temp_c", "slowdown_frac"))
# The host's and GPUs' readings of the gen phase. A rollout that ran ahead (overlap) ran during the last step's
# training, and the step's gen phase is only the wait for its end: these are null there, not the wait's readings.
ROLLOUT_READINGS = (*(k for k in HOST if k.endswith("_gen")), *(k for k in GPU if k.endswith("_gen")))
ROLLOUT = (
    "perf/gen_tokens", "perf/throughput", "perf/ttft_s_mean", "perf/ttft_s_p50", "perf/ttft_s_p99",
    "perf/itl_ms_mean", "perf/itl_ms_p50", "perf/itl_ms_p99", "perf/tpot_ms_mean", "perf/tpot_ms_p50",
    "perf/tpot_ms_p99", "perf/latency_s_p50", "perf/latency_s_p99", "errors/requests_failed",
    # the rollout client: how many requests it streamed and how finely, and the most it can absorb on this host
    "perf/streamed_requests", "perf/events_per_token", "perf/client_ceiling_tok_s",
    # the engine's own timing of every request, streamed or whole (run key engine_timing)
    "perf/engine_ttft_s_p50", "perf/engine_ttft_s_p99", "perf/engine_tpot_ms_p50", "perf/engine_tpot_ms_p99",
    "perf/engine_timed_requests",
    # the step whose adapter rolled out this step's samples, and how many steps older it is than the trainer's
    "rollout/adapter_step", "rollout/staleness",
)
# perf/train_tok_s is the trainer's, over its update alone (as perf/mfu); perf/update_actor_tok_s is the loop's, over
# the whole update_actor phase (the trainer's step as the loop times it: the update and the trainer's overheads around
# it, such as a worker's round trip; onload, adapter export and the optimizer state handed on are phases of their
# own). Older runs recorded the phase's figure as perf/train_tok_s.
TRAINING = ("perf/train_tokens", "perf/train_tok_s", "perf/update_actor_tok_s", "train/loss", "train/grad_norm",
            "train/kl", "train/clipfrac",
            # the policy's mean entropy over the completion tokens in the update's forward (verl's actor/entropy)
            "train/entropy",
            # the trainer's own timing of the update (no adapter export): model FLOP utilisation against the GPU's
            # dense bf16 peak (None on CPU; hybridrl.trainers.flops states the count), completion tokens/s per
            # trainer GPU, the update's model FLOPs, and whether the frozen base stayed on the GPU during rollout;
            # which kernel ran the MoE experts (grouped_mm, or loop / eager per expert; null for a dense model);
            # how many times the Megatron ranks' process groups were made again after an offload freed them
            # (release_comms; null where they are never freed); whether the output head ran chunk by chunk over the
            # completion tokens (chunked_head) rather than as the model's full logits
            "perf/mfu", "perf/train_tok_s_per_gpu", "perf/update_flops", "train/keep_base_on_gpu",
            "train/experts_impl", "train/comms_remade", "train/chunked_head")
# the engine's GPUs asleep less what the trainer's processes (and a controller that is not the engine) hold there:
# what the asleep gate judges (placement.Colocate.asleep_own)
ENGINE_ASLEEP_OWN = "mem/engine_asleep_own_gb"
# onload_beside_release (run/onload_beside_release.py): whether the step ran the trainer's onload beside the release
# of the engine's weights (null where the run does not ask), the most its last onload done alone took on a GPU (GB),
# and the two sides' own seconds within release_onload
PLACEMENT = ONLOAD_BESIDE
# mem/used_gb_train is the sampler's update_actor phase; mem/trainer_gb_gen is NVML over the trainer's processes
MEMORY = ("mem/used_gb_gen", "mem/used_gb_train", "mem/peak_gb", "mem/kv_capacity_tokens", "mem/trainer_gb_gen",
          # NVML on the engine's GPUs right after its sleep and its wake, and what the controller holds there;
          # engine_started_gb right after a start (the step in which the engine started), which wakes are held to
          "mem/engine_asleep_gb", "mem/engine_awake_gb", "mem/controller_gb", "mem/engine_started_gb",
          ENGINE_ASLEEP_OWN)
# response_length/clip_ratio (verl's name): share of rollouts cut at max_new_tokens; response/stop_ratio: share that
# ended at EOS (finish reason "stop"); the rest failed or gave no reason
LEARNING = ("reward/mean", "reward/accuracy", "response_length/mean", "response_length/clip_ratio",
            "response/stop_ratio")
# check/adapter_applied is null where the canary cannot judge the adapter, and check/adapter_not_judged says why
# (one of these); False is only ever a non-identity adapter the engine did not apply, and it stops the run
IDENTITY_ADAPTER = "identity adapter"  # LoRA's B all zero (no gradient yet): it changes nothing any engine can show
NO_ADAPTER = "no adapter"  # nothing trained (trainer: none): the engine serves the base model
CHECKS = (
    "check/rollout_logprob_abs_diff", "check/logprob_gap_sample_max", "check/logprob_gap_token_max",
    "check/logprob_gap_max", "check/logprob_gap_fail_at", "check/logprob_gap_tier",
    "check/base_canary_ok", "check/adapter_applied", "check/adapter_not_judged", "check/adapter_logprob_shift",
    "check/kv_capacity_ok", "check/logprob_agreement_ok", "check/client_headroom_ok",
    "check/asleep_growth_gb", "check/asleep_memory_ok", "check/awake_shortfall_gb", "check/awake_memory_ok",
    "errors/engine_restarts",
)
BOOLS = ("check/base_canary_ok", "check/adapter_applied", "check/kv_capacity_ok", "check/logprob_agreement_ok",
         "check/client_headroom_ok", "check/asleep_memory_ok", "check/awake_memory_ok")
# engine-vs-trainer mismatch per token over the batch (hybridrl.task.rl.LogprobGaps), verl's rollout_is metrics
MISMATCH = ("mismatch/kl_k3", "mismatch/is_weight_mean", "mismatch/ess", "mismatch/is_capped_frac")
STRINGS = ("run_id", "engine", "placement", "trainer", "model", "check/logprob_gap_tier", "check/adapter_not_judged",
           "train/experts_impl",
           *(f"host/busiest_thread_{p}" for p in CONTROLLER_CPU_PHASES))
RECORD_KEYS = (*IDENTITY, *TIMING, *CONCURRENCY, *ROLLOUT, *TRAINING, *MEMORY, *PLACEMENT, *LEARNING, *HOST, *GPU,
               *CHECKS, *MISMATCH, *RUN_START, *ENGINE_START_SPLIT, *ENGINE_RESTART, *EVAL, "time_unix")


def new_record() -> dict[str, Any]:
    """A step's record before anything is known: every key, each None."""
    return dict.fromkeys(RECORD_KEYS)
