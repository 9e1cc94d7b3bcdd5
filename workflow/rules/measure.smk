# The study's measurements that are not training runs (config: `measurements`), each a job of its own whose
# inputs are what it really reads: an engine bench and a start bench wait for their run's done.json, a fault
# run trains its run, the trainer tools and the client's ceiling wait for nothing. One rule per kind and GPU count,
# as train rules are, so that a SLURM array never mixes jobs that need different GPUs. Results:
# results/bench/<name>.json|txt.


def measure_inputs(wildcards) -> dict[str, str]:
    job = MEASUREMENTS[wildcards.name]
    if job.run_id is None:
        return {}
    run = RUNS[job.run_id]
    inputs = {
        "config": f"results/runs/{job.run_id}/config.json",
        "model": f"resources/models/{run.model}",
        "data": f"{DATA_DIR}/train.jsonl",
    }
    # after the run: it replays a step of it, or finds the machine's compile caches filled
    if job.kind in ("engine_bench", "start_bench"):
        inputs["done"] = f"results/runs/{job.run_id}/done.json"
    return inputs


def measure_command(wildcards) -> str:
    job = MEASUREMENTS[wildcards.name]
    rid = job.run_id
    run = RUNS[rid] if rid else None
    at = (
        Inputs(
            run_dir=f"results/runs/{rid}",
            run_config=f"results/runs/{rid}/config.json",
            model=f"resources/models/{run.model}",
            data=DATA_DIR,
        )
        if run
        else Inputs()
    )
    trainer = getattr(job.spec, "trainer", None)
    # TRL's peer colocates vLLM in its own process, whatever engine the run it mirrors uses
    peer = job.kind == "peer_trl"
    engine = cluster.PEER_ENGINE if peer else None
    record = f"python -m hybridrl.study.cluster record-job results/bench/{job.name}.slurm.json --sharing {SHARING}"
    command = shlex.join(["python", "-m", "hybridrl", *measure_argv(job, at)])
    return f"{prelude(rid, trainer, engine, peer)}{record} && {command}"


def measure_container(wildcards) -> str | None:
    """A measurement of a run (engine bench, fault run) runs in that run's image, TRL's peer in the vLLM image;
    the trainer tools and the client's ceiling on the host, as the model builds do."""
    job = MEASUREMENTS[wildcards.name]
    rid = job.run_id
    if rid and (APPTAINER or not workflow.is_main_process):
        image = image_of(rid)
        if image and job.kind == "peer_trl":
            return f"resources/containers/{cluster.backend(cluster.PEER_ENGINE)}.sif"
        return image
    return None


def measure_gpus(wildcards) -> int:
    return cluster.measure_gpus(MEASUREMENTS[wildcards.name], fake=FAKE_GPUS)


MEASURE_RULES = cluster.measure_shapes(MEASUREMENTS, fake=FAKE_GPUS)
if ONE_AT_A_TIME:
    MEASURE_RULES = cluster.one_rule_a_job(MEASURE_RULES)


for _rule, _names in MEASURE_RULES.items():

    rule:
        name:
            _rule
        input:
            unpack(measure_inputs),
        output:
            (
                "results/bench/{name}.txt"
                if _rule.startswith("trainer_profile")
                else "results/bench/{name}.json"
            ),
        log:
            "logs/measure/{name}.log",
        wildcard_constraints:
            name="|".join(re.escape(name) for name in _names),
        priority: 0
        conda:
            "../envs/hybridrl.yaml"
        container:
            measure_container
        threads: lambda wildcards: cluster.measure_threads(MEASUREMENTS[wildcards.name], CORES)
        resources:
            gpu=measure_gpus,
            slurm_extra=measure_sbatch,
            runtime=lambda wildcards, attempt: MEASUREMENTS[
                wildcards.name
            ].spec.minutes
            * attempt,
        params:
            command=measure_command,
        shell:
            "{params.command} > {log} 2>&1"
