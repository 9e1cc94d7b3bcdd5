rule run_config:
    output:
        "results/runs/{run_id}/config.json",
    params:
        spec=run_spec,
    log:
        "logs/run_config/{run_id}.log",
    run:
        Path(output[0]).write_text(params.spec)


rule train:
    input:
        config="results/runs/{run_id}/config.json",
        model=run_model,
        data=f"{DATA_DIR}/train.jsonl",
    output:
        done="results/runs/{run_id}/done.json",
    params:
        out=lambda wildcards, output: Path(output.done).parent,
        data=lambda wildcards, input: Path(input.data).parent,
    log:
        "logs/train/{run_id}.log",
    threads: run_threads
    resources:
        gpu=run_gpus,
    shell:
        "python -m hybridrl train --run-config {input.config} --model {input.model} --data {params.data}"
        " --out {params.out} --done {output.done} --no-progress 2>&1 | tee {log}"
