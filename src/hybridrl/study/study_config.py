"""A study file's typed form: every top-level key with its type, default and meaning, in one place.

A study declares everything that runs: the data and models its rules build, the runs (as partial RunConfig
entries), the measurements that are not training runs (engine and trainer benchmarks, the rollout client's ceiling,
fault runs, TRL's trainer as a peer) and the node they run on. workflow/schemas/config.schema.yaml is generated
from these models (`python -m hybridrl schema`), and a test keeps the committed file equal to what they generate.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from hybridrl.study.run_config import run_schema


class _Strict(BaseModel):
    # as RunConfig: no coercion, unknown keys refused, defaults validated like given values
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid", validate_default=True)


class DataSpec(_Strict):
    """The problems every run of the study draws its prompts from."""

    source: Literal["gsm8k", "synthetic"] = Field(
        description="gsm8k: the real problems, downloaded once; synthetic: GSM8K-format problems made offline")
    n_train: int | None = Field(None, ge=1, description="synthetic problems in the train split (default 512)")
    n_test: int | None = Field(None, ge=1, description="synthetic problems in the test split (default 128)")
    seed: int | None = Field(None, ge=0, description="seed of the synthetic problems (default 0)")
    steps: Literal[1, 2, 3] | None = Field(
        None, description="synthetic: most arithmetic steps per problem; 1 (default): one step, small numbers; "
                          "2-3: two or three steps, numbers up to ~1,000")


class WarmStart(_Strict):
    """Supervised training of a random-init model before any RL."""

    tokens: int = Field(ge=1, description="token budget: prompt and answer tokens the model trains on")
    lr: float | None = Field(None, gt=0, strict=False,
                             description="AdamW peak learning rate (default 3e-3; linear warm-up, cosine decay)")
    batch_size: int | None = Field(None, ge=1, description="problems per optimizer step (default 32)")
    warmup_frac: float | None = Field(
        None, ge=0, le=1, strict=False, description="share of the steps spent warming up the learning rate "
                                                    "(default 0.05)")
    eval_problems: int | None = Field(None, ge=1, description="test problems of the base accuracy (default 64)")
    max_new_tokens: int | None = Field(None, ge=1, description="greedy tokens per test problem (default 64)")
    seed: int | None = Field(None, ge=0, description="order of the training problems (default 0)")
    device: Literal["cpu", "cuda"] | None = Field(None, description="where it trains (default: cuda where there "
                                                                    "is a GPU)")
    target_accuracy: float | None = Field(
        None, ge=0, le=1, strict=False, description="stop before the budget once the held-out train problems reach "
                                                    "this greedy accuracy (default: train the whole budget)")
    check_tokens: int | None = Field(None, ge=1, description="tokens between two held-out checks (default: a fifth "
                                                              "of the budget); only with target_accuracy")
    check_problems: int | None = Field(None, ge=1, description="train problems held out of the training for the "
                                                                "checks (default 128); only with target_accuracy")


class ModelSpec(_Strict):
    """A model: a Hugging Face id, a local checkpoint, or a random-init architecture built offline."""

    hf_id: str | None = Field(None, description="Hugging Face id, downloaded once")
    revision: str | None = Field(None, description="the Hugging Face revision (default: main)")
    path: str | None = Field(None, description="an existing local checkpoint")
    init: Literal["random"] | None = Field(None, description="random: built here with random weights")
    arch: Literal["qwen3", "llama", "qwen2", "qwen3_moe"] | None = Field(None, description="architecture of a "
                                                                                          "random-init model")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="weights' dtype")
    tokenizer: Literal["trained", "qwen"] | None = Field(
        None, description="random model: trained (default): a small BPE trained on the study's text; qwen: Qwen's "
                          "real tokenizer, and the model takes Qwen3's 151,936 vocab rows")
    vocab_size: int | None = Field(None, ge=64, description="random model, tokenizer trained: BPE target size")
    vocab_multiple: int | None = Field(None, ge=1, description="random model: pad the model's vocab to a multiple "
                                                               "of this (default 128)")
    hidden_size: int | None = Field(None, ge=8, description="width of the residual stream")
    intermediate_size: int | None = Field(None, ge=8, description="width of the dense MLP")
    num_hidden_layers: int | None = Field(None, ge=1, description="transformer layers")
    num_attention_heads: int | None = Field(None, ge=1, description="query heads")
    num_key_value_heads: int | None = Field(None, ge=1, description="key/value heads (grouped-query attention)")
    head_dim: int | None = Field(None, ge=4, description="width of one attention head")
    max_position_embeddings: int | None = Field(None, ge=64, description="longest sequence the model takes")
    num_experts: int | None = Field(None, ge=1, description="qwen3_moe: experts per MoE layer")
    num_experts_per_tok: int | None = Field(None, ge=1, description="qwen3_moe: experts each token is routed to")
    moe_intermediate_size: int | None = Field(None, ge=8, description="qwen3_moe: width of one expert's MLP")
    norm_topk_prob: bool | None = Field(None, description="qwen3_moe: renormalise the top-k router weights")
    tie_word_embeddings: bool | None = Field(None, description="share the input embedding with the LM head")
    seed: int | None = Field(None, ge=0, description="seed of the random weights")
    init_device: Literal["cpu", "cuda"] | None = Field(
        None, description="random model: where its weights are drawn (default cpu). cuda draws them on a GPU (the "
                          "build becomes a GPU job), in the model's dtype where there is no warm start: seconds, not "
                          "minutes, for the 48-layer MoE, but other weights than cpu gives for the same seed")
    warm_start: WarmStart | None = Field(
        None, description="random model: supervised training on the train split (prompt, worked answer, EOS) before "
                          "any RL; its greedy test accuracy goes to warm_start.json in the model's directory")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in ("hf_id", "path") if getattr(self, k) is not None]
        if self.init is not None or self.arch is not None:
            given.append("init+arch")
        if len(given) != 1 or (given == ["init+arch"] and (self.init is None or self.arch is None)):
            raise ValueError("a model needs exactly one of hf_id, path, or init and arch together")
        return self


class EngineEnv(_Strict):
    """How one engine's server process is started."""

    python: str | None = Field(None, description="the Python that runs the engine's server (default: python)")
    env: dict[str, str] = Field({}, description="extra environment variables of the engine's process")


class EngineEnvs(_Strict):
    """Per engine: the Python that runs its server and extra environment variables."""

    vllm: EngineEnv | None = Field(None, description="the vLLM server")
    sglang: EngineEnv | None = Field(None, description="the SGLang server")
    vllm_inprocess: EngineEnv | None = Field(None, alias="vllm-inprocess",
                                             description="in-process vLLM (it runs in the controller)")


class Node(_Strict):
    """The machine a study's jobs run on, and whether they may share it."""

    gpus: int | None = Field(None, ge=1, description="GPUs of one node; a run or measurement that needs more is "
                                                     "refused at validation (default: not checked)")
    sharing: Literal["side_by_side", "one_at_a_time"] = Field(
        "side_by_side", description="side_by_side: SLURM may run jobs together on disjoint GPU sets of one node; "
                                    "one_at_a_time: each job has the node alone (sbatch --exclusive), so no run is "
                                    "measured beside another")


class _Measurement(_Strict):
    minutes: int = Field(30, ge=1, description="the job's time limit in minutes")
    after_round: int | None = Field(None, ge=1, description="its place in the study's order: after round K of the "
                                                            "runs, before round K + 1 (default: after every run)")


class EngineBench(_Measurement):
    """The engine alone on one step's request set of a finished run, with raw HTTP probes (`hybridrl bench`)."""

    kind: Literal["engine_bench"] = Field(description="engine_bench")
    run: str = Field(description="the run it replays, by name (a run's `name`, else engine-placement[-megatron]; "
                                 "replicate k > 1 as NAME-rK); it starts after that run is done")
    step: int = Field(3, ge=1, description="the step whose requests and adapter it replays")
    repeats: int = Field(5, ge=1, description="repeats of every rollout path, interleaved")
    args: tuple[str, ...] = Field((), strict=False, description="more arguments of `python -m hybridrl bench`, "
                                                                 "e.g. [--paths, raw, client]")


class ClientCeiling(_Measurement):
    """The most tokens/s the rollout client absorbs on this host, against a fake engine (no GPU)."""

    kind: Literal["client_ceiling"] = Field(description="client_ceiling")
    args: tuple[str, ...] = Field((), strict=False, description="more arguments of `python -m hybridrl "
                                                                 "client-ceiling`")


class TrainerBench(_Measurement):
    """One trainer on a fixed batch of a named shape, in a process of its own (`hybridrl trainer-bench` or
    `trainer-profile`)."""

    kind: Literal["trainer_bench", "trainer_profile"] = Field(
        description="trainer_bench: best and median update time, tokens/s, MFU; trainer_profile: the operators that "
                    "take one update's time")
    shape: Literal["qwen3-0.6b", "qwen3-30b-a3b", "tiny", "tiny-moe"] = Field(description="the model shape")
    trainer: Literal["hf", "megatron"] = Field(description="the trainer")
    micro_batch: int = Field(ge=1, description="samples a forward pass")
    flags: tuple[str, ...] = Field((), strict=False, description="passed on as --FLAG (no-pack, varied, peft-lora, "
                                                                  "chunked-head, vocab=151936 as --vocab=151936; "
                                                                  "trainer_bench: ep=2 as --ep=2, the megatron "
                                                                  "trainer on 2 GPUs by expert parallelism)")
    replicates: int = Field(1, ge=1, description="processes of their own, each a result file (-rK)")


class FaultRun(_Measurement):
    """A run hit on purpose and started again (`hybridrl fault-run`); the run is trained only through it."""

    kind: Literal["fault_run"] = Field(description="fault_run")
    run: str = Field(description="the run, by name (as engine_bench's run)")
    kill_engine_at: int = Field(ge=1, description="step whose rollout loses its engine (SIGKILL to its group)")
    term_at: int = Field(ge=1, description="step whose training gets SIGTERM, as SLURM's preemption sends")
    minutes: int = Field(60, ge=1, description="the job's time limit in minutes")


class PeerTrl(_Measurement):
    """TRL's GRPOTrainer on a run's model, prompts, reward and batch, vLLM colocated with sleep mode
    (`hybridrl peer-trl`; the settings that differ from hybridrl's are listed in docs/study-config.md)."""

    kind: Literal["peer_trl"] = Field(description="peer_trl")
    run: str = Field(description="the run it mirrors, by name (as engine_bench's run): its model, data, prompts, "
                                 "reward, batch, LoRA and sampling; it does not wait for that run")
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]+$",
                             description="its result's stem (default trl-RUN-defaults, or -gc-on / -gc-off)")
    gradient_checkpointing: bool | None = Field(
        None, description="TRL's gradient checkpointing; left out: TRL's default (on)")
    vllm_sleep: bool = Field(True, description="TRL's vllm_enable_sleep_mode: vLLM sleeps at level 2 while TRL "
                                               "trains; false keeps it awake beside the model (as a run's "
                                               "engine_sleep false), and its result's stem ends in -awake")
    lr: float | None = Field(None, gt=0, strict=False, description="learning rate (default: the run's)")
    steps: int | None = Field(None, ge=1, description="optimizer steps (default: the run's)")
    micro_batch: int = Field(32, ge=1, description="completions a forward (TRL's per_device_train_batch_size); it "
                                                   "must divide prompts_per_step x group_size, the rest accumulates "
                                                   "into one optimizer step")
    replicates: int = Field(1, ge=1, description="processes of their own, each a result file (-rK), which the "
                                                 "report pools into one configuration (intervals over processes); "
                                                 "process K goes after round after_round + K - 1")

    @property
    def result_name(self) -> str:
        gc = {None: "defaults", True: "gc-on", False: "gc-off"}[self.gradient_checkpointing]
        return self.name or f"trl-{self.run}-{gc}" + ("" if self.vllm_sleep else "-awake")


class StartBench(_Measurement):
    """A run's engine started through hybridrl against the same engine started bare by its own command line
    (`hybridrl start-bench`), alternated, after the run (so that both find the machine's compile caches filled)."""

    kind: Literal["start_bench"] = Field(description="start_bench")
    run: str = Field(description="the run whose engine, flags and environment are started, by name")
    repeats: int = Field(2, ge=2, description="starts of each path; the first of each is reported apart")


Measurement = Annotated[EngineBench | ClientCeiling | TrainerBench | FaultRun | PeerTrl | StartBench,
                        Field(discriminator="kind")]


class StudyConfig(_Strict):
    """One study: shared data, models and engine environments, the runs, and the measurements beside them."""

    study: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="the study's name (its archive is named after it)")
    data: DataSpec = Field(description="the problems every run draws its prompts from")
    models: dict[str, ModelSpec] = Field(min_length=1, description="the models, by the name runs give in `model`")
    engine_envs: EngineEnvs = Field(default_factory=EngineEnvs, description="per engine: the Python that runs its "
                                                                            "server and extra environment variables")
    defaults: dict[str, Any] = Field(description="keys every run takes unless its entry sets them")
    runs: list[dict[str, Any]] = Field(min_length=1, description="the configurations; each entry is merged over "
                                                                  "`defaults`")
    order: Literal["rounds", "balanced"] = Field(
        "rounds", description="rounds: replicate k of every configuration before replicate k + 1 (A1 B1 A2 B2); "
                              "balanced: every second round reversed (A1 B1 B2 A2), so that no configuration always "
                              "runs first")
    node: Node = Field(default_factory=Node, description="the node the study's jobs run on")
    run_minutes: int | None = Field(None, ge=1, description="a training run's job time limit in minutes "
                                                            "(default: the profile's runtime)")
    measurements: list[Measurement] = Field([], description="what is measured beside the runs, each a job of its "
                                                            "own that waits only for what it reads")


def _inline(node: Any, defs: dict[str, Any], is_properties: bool = False) -> Any:
    """Pydantic's schema with every $ref inlined, titles dropped and optional keys (X or null, default null)
    written as plain X: the study file leaves such a key out."""
    if isinstance(node, list):
        return [_inline(x, defs) for x in node]
    if not isinstance(node, dict):
        return node
    options = node.get("anyOf")
    if options and {"type": "null"} in options and node.get("default", 0) is None:
        rest = [o for o in options if o != {"type": "null"}]
        node = {**{k: v for k, v in node.items() if k not in ("anyOf", "default")},
                **(rest[0] if len(rest) == 1 else {"anyOf": rest})}
    if "$ref" in node:
        node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
    node.pop("discriminator", None)  # an OpenAPI keyword; the `kind` enum of each option says the same
    return {k: _inline(v, defs, is_properties=k == "properties" and not is_properties) for k, v in node.items()
            if is_properties or k != "title"}


def study_schema() -> dict[str, Any]:
    """The JSON schema of a study file, as workflow/schemas/config.schema.yaml holds it."""
    raw = StudyConfig.model_json_schema(by_alias=True)
    schema = _inline(raw, raw.pop("$defs", {}))
    schema["properties"]["defaults"] = {"$ref": "#/$defs/run", "description": "keys every run takes unless its "
                                                                              "entry sets them"}
    schema["properties"]["runs"]["items"] = {"$ref": "#/$defs/run"}
    # one source a model: a schema reader sees it where ModelSpec's validator says it
    schema["properties"]["models"]["additionalProperties"]["oneOf"] = [
        {"required": ["hf_id"]}, {"required": ["path"]}, {"required": ["init", "arch"]}]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "hybridrl study",
            **schema, "$defs": {"run": run_schema()}}
