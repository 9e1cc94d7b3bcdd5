rule model:
    input:
        corpus=f"{DATA_DIR}/train.jsonl",
    output:
        directory("resources/models/{model}"),
    params:
        spec=lambda wildcards: json.dumps(STUDY.models[wildcards.model], sort_keys=True),
    log:
        "logs/model/{model}.log",
    conda:
        "../envs/hybridrl.yaml"
    shell:
        "python -m hybridrl model --spec {params.spec:q} --corpus {input.corpus} --out {output} > {log} 2>&1"
