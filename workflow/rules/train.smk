rule train:
    input:
        model=run_model,
        data=f"{DATA_DIR}/train.jsonl",
    output:
        done="results/runs/{run_id}/done.json",
    params:
        spec=run_spec,
        out="results/runs/{run_id}",
    log:
        "logs/train/{run_id}.log",
    resources:
        gpu=run_gpus,
    shell:
        "echo {params.spec:q} > {params.out}/config.json.tmp && mv {params.out}/config.json.tmp {params.out}/config.json"
        " && python -m hybridrl train --run-config {params.out}/config.json --model {input.model}"
        " --data {DATA_DIR} --out {params.out} --done {output.done} --no-progress 2>&1 | tee {log}"
