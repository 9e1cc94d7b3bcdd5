# One Apptainer image per backend, built from containers/<backend>.def as an output of the DAG. The
# train rules of GPU runs take their backend's image as an input and run in it through `container:`
# (--sdm apptainer, which slurm/config.v8+.yaml sets). The build runs on the login node: it needs the
# network, which compute nodes often lack.


localrules:
    container,


rule container:
    # `run` rather than `shell`: this rule makes a software environment, it cannot run in one
    input:
        definition="containers/{backend}.def",
        pins=lambda wildcards: [
            f"containers/pins/{name}.txt"
            for name in ("base", wildcards.backend, "trainer")
        ],
    output:
        image="resources/containers/{backend}.sif",
        digest="resources/containers/{backend}.sif.json",
    log:
        "logs/containers/{backend}.log",
    wildcard_constraints:
        backend="sglang|vllm",
    run:
        script = Path(workflow.basedir) / "scripts" / "build-container.sh"
        shell(
            f"bash {script} {{wildcards.backend}} {{output.image}} {{output.digest}} > {{log}} 2>&1"
        )
