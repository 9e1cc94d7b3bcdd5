"""Commands and ids the docs give, checked against what they really do."""

import re
import shlex
from pathlib import Path

import pytest

from hybridrl.study.config import load_study

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Snakemake options that take every following word as a value: a target written after one is swallowed.
GREEDY = {"--configfile", "--configfiles", "--forcerun", "-R", "--until", "-U", "--omit-from", "-O", "--config",
          "-C", "--set-resources", "--set-threads", "--default-resources"}


def _snakemake_commands(path: Path) -> list[list[str]]:
    """Each `snakemake ...` command in the file's fenced code blocks, continued lines joined."""
    commands = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            words = shlex.split(line, comments=True)
            if words[:1] == ["snakemake"] or words[1:2] == ["snakemake"]:
                commands.append(words[words.index("snakemake"):])
    return commands


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_target_is_swallowed_by_an_option(path):
    for words in _snakemake_commands(path):
        for i, word in enumerate(words):
            if word in GREEDY:
                values = []
                for value in words[i + 1:]:
                    if value.startswith("-"):
                        break
                    values.append(value)
                assert len(values) == 1, f"{path.name}: {' '.join(words)}: {word} takes {values}"


def test_readme_example_run_id_is_a_run_of_the_smoke_study():
    ids = [rid for doc in DOCS for rid in re.findall(r"`(vllm-\w+-hf-tiny-qwen3-[0-9a-f]{8})`", doc.read_text())]
    assert ids
    runs = load_study(REPO / "config" / "smoke.yaml").runs
    for rid in ids:
        assert rid in runs, f"README names {rid}; `python -m hybridrl validate --config config/smoke.yaml` " \
                            f"lists {', '.join(runs)}"


def test_client_ceiling_tables_are_the_committed_benchmark():
    """A client-ceiling table in a README is the table its committed JSON gives, figure for figure."""
    import json

    from hybridrl.engines.client_ceiling import markdown_table

    found = 0
    for path in [*DOCS, *sorted((REPO / "results" / "reference").glob("*/README.md"))]:
        text = path.read_text()
        for source, table in re.findall(r"<!-- client-ceiling: (\S+) -->\n(.*?)<!-- /client-ceiling -->", text, re.S):
            rows = json.loads((REPO / source).read_text())["settings"]
            assert table == markdown_table(rows), f"{path.name}: the table differs from {source}"
            found += 1
    assert found, "no client-ceiling table found in the READMEs"


def test_the_readme_layout_names_every_module_where_it_is() -> None:
    """README's Layout section follows the code: each package's line names exactly its modules."""
    import re

    text = (REPO / "README.md").read_text()
    block = text[text.index("src/hybridrl/ "):text.index("scripts/setup.sh ")]
    src = REPO / "src" / "hybridrl"
    named: dict[str, set[str]] = {}
    where = ""
    for line in block.splitlines()[1:]:
        m = re.match(r"  (\w+)/ ", line)
        if m:
            where = m[1]
        elif not line.startswith("             "):
            where = ""  # a top-level line
        named.setdefault(where, set()).update(re.findall(r"(?<![/\w])(\w+)\.py\b", line))
    for pkg, modules in named.items():
        on_disk = {p.stem for p in (src / pkg).glob("*.py")} - {"__init__", "__main__"}
        assert modules == on_disk, (pkg or "src/hybridrl", sorted(modules ^ on_disk))


def test_cluster_doc_gives_the_log_path_of_the_profiles_job_arrays() -> None:
    """The profile submits arrays, which the SLURM plugin logs to <logdir>/rule_<rule>/%A_%a.log: the doc gives
    that path, and gives the per-job path (sbatch's %j, under the run id) only for a run that went out alone."""
    import importlib.util

    import yaml

    profile = yaml.safe_load((REPO / "slurm" / "config.v8+.yaml").read_text())
    assert profile["slurm-array-jobs"] == "all"
    logdir = profile["slurm-logdir"]
    spec = importlib.util.find_spec("snakemake_executor_plugin_slurm")
    if spec and spec.origin:  # the plugin's own pattern, where it is installed
        assert 'group_or_rule / r"%A_%a.log"' in Path(spec.origin).read_text()
    text = (REPO / "docs" / "cluster.md").read_text()
    assert f"`{logdir}/rule_<rule>/<array job id>_<task>.log`" in text and "`%A_%a.log`" in text
    sentences = [s for s in re.split(r"(?<=\.)\s+", text) if "<jobid>.log" in s]
    assert all("alone" in s for s in sentences), [s for s in sentences if "alone" not in s]


def _localrules() -> set[str]:
    """Every rule named in a `localrules:` declaration of the Snakefile and its rule files."""
    names: set[str] = set()
    for path in [REPO / "Snakefile", *sorted((REPO / "workflow" / "rules").glob("*.smk"))]:
        for m in re.finditer(r"^localrules:(.*\n(?:[ \t]+\S.*\n)*)", path.read_text(), flags=re.M):
            names.update(n for n in re.split(r"[\s,]+", m[1]) if n)
    return names


# How the login-node list of docs/cluster.md names a rule, where not by the rule's own name.
CLUSTER_DOC_NAMES = {"run_config": "run configs", "container": "image builds", "model_download": "model downloads"}


def test_cluster_doc_login_node_list_names_every_localrule() -> None:
    rules = _localrules() - {"all"}  # `all` only gathers targets
    assert {"data", "model_download", "container"} <= rules, rules
    text = (REPO / "docs" / "cluster.md").read_text()
    paragraph = next(p for p in text.split("\n\n") if "`localrules`" in p)
    missing = [r for r in sorted(rules) if not re.search(rf"\b{re.escape(CLUSTER_DOC_NAMES.get(r, r))}\b", paragraph)]
    assert not missing, f"docs/cluster.md's login-node list leaves off {missing}"
