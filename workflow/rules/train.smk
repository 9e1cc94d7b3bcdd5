rule run_config:
    output:
        "results/runs/{run_id}/config.json",
    log:
        "logs/run_config/{run_id}.log",
    params:
        spec=run_spec,
    run:
        Path(output[0]).write_text(params.spec)


# One rule per job shape (train_cpu, train_gpu1, train_gpu2, ...; see TRAIN_RULES in common.smk), so
# that a SLURM job array never mixes runs that need different GPU counts. Target runs by file:
# results/runs/<run_id>/done.json. The log is appended to, so a requeued job keeps its first attempt.
for _name, _run_ids in TRAIN_RULES.items():

    rule:
        name:
            _name
        input:
            config="results/runs/{run_id}/config.json",
            model=run_model,
            data=f"{DATA_DIR}/train.jsonl",
            image=run_image,
        output:
            done="results/runs/{run_id}/done.json",
        log:
            "logs/train/{run_id}.log",
        wildcard_constraints:
            run_id="|".join(re.escape(rid) for rid in _run_ids),
        priority: run_priority
        container:
            run_container
        threads: run_threads
        resources:
            **RUN_LIMITS,
            gpu=run_gpus,
            gpu_model=run_gpu_model,
            slurm_extra=run_sbatch,
        params:
            out=lambda wildcards, output: Path(output.done).parent,
            data=lambda wildcards, input: Path(input.data).parent,
            prelude=run_prelude,
            sharing=SHARING,
        shell:
            "{params.prelude}python -m hybridrl.study.cluster record-job {params.out}/slurm.json"
            " --sharing {params.sharing} && python -m hybridrl train --run-config {input.config} --model {input.model} --data {params.data}"
            " --out {params.out} --done {output.done} --no-progress 2>&1 | tee -a {log}"
