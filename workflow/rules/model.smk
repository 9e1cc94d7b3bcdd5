rule model:
    input:
        corpus=f"{DATA_DIR}/train.jsonl",
        test=f"{DATA_DIR}/test.jsonl",  # a warm-started model's base accuracy is measured on it
    output:
        directory("resources/models/{model}"),
    params:
        spec=run_model_spec,
    log:
        "logs/model/{model}.log",
    # a warm start trains on the CPU's cores where there is no GPU; nothing else runs before the models anyway
    threads: CORES
    conda:
        "../envs/hybridrl.yaml"
    shell:
        "python -m hybridrl model --spec {params.spec:q} --corpus {input.corpus} --test {input.test} --out {output}"
        " > {log} 2>&1"
