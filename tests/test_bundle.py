"""The Databricks bundle (databricks.yml, resources/*.yml), tested as far as no workspace is needed.

:func:`resolve_bundle` does offline what ``databricks bundle validate -t <target>`` does to the variables: it
merges the included files, gives every declared variable its value (``--var`` over ``BUNDLE_VAR_<name>`` over
the target's value over the default) and substitutes every ``${var.<name>}``; a variable referenced but not
declared, or declared with no value, is a :class:`BundleError` naming it. The job resources then load with the
``databricks-bundles`` package (its ``Job.from_dict`` refuses unknown fields and wrong types), every entry point
they name is in the built wheel, and the configuration the jobs name parses with spark_sb.config in the
environment the job clusters get."""

from __future__ import annotations

import copy
import json
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from databricks.bundles.jobs import Job
from test_packaging import build_wheel, resolve, wheel_entry_points, wheel_requires

from spark_sb.config import load_config
from spark_sb.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("dev", "prod")
#: what a production deployment must name (--var): prod gives these no value
PROD = {"catalog": "sales", "alert_email": "payments-oncall@example.com",
        "service_principal": "6f1c2a9e-0000-4000-8000-00000000abcd", "operators_group": "payments-operators"}
#: what the CLI fills in from the workspace it deploys to; placeholders here
WORKSPACE = {"workspace.current_user.short_name": "jane_doe", "workspace.current_user.userName": "jane.doe@example.com",
             "workspace.file_path": "/Workspace/Users/jane.doe@example.com/.bundle/spark-sb/{target}/files"}
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w-]*(?:\.[A-Za-z_][\w-]*)*)\}")
#: the file ``databricks bundle`` reads variable values from, after --var and BUNDLE_VAR_<name>
_OVERRIDES = ".databricks/bundle/{target}/variable-overrides.json"
_SECRET = re.compile(r"^\{\{secrets/([^/{}]+)/([^/{}]+)\}\}$")


class BundleError(Exception):
    """A bundle configuration the CLI would refuse, naming what is wrong."""


def _merge(base: dict[str, Any], extra: Mapping[str, Any], where: str, *, override: bool = False) -> None:
    """Merge ``extra`` into ``base``: an included file may not redefine a value; a target overrides one."""
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value, f"{where}.{key}", override=override)
        elif key in base and base[key] != value and not override:
            raise BundleError(f"{where}.{key} is defined twice")
        else:
            base[key] = copy.deepcopy(value)


def _references(value: Any, path: str = "") -> list[tuple[str, str]]:
    """``(reference, where)`` of every ``${...}`` in ``value``."""
    if isinstance(value, Mapping):
        return [found for k, v in value.items() for found in _references(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [found for i, v in enumerate(value) for found in _references(v, f"{path}[{i}]")]
    return [(m.group(1), path) for m in _REFERENCE.finditer(value)] if isinstance(value, str) else []


def _substitute(value: Any, values: Mapping[str, Any]) -> Any:
    if isinstance(value, Mapping):
        return {k: _substitute(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, values) for v in value]
    if not isinstance(value, str):
        return value
    whole = _REFERENCE.fullmatch(value)
    if whole and whole.group(1) in values:  # a whole-string reference keeps the value's type, as the CLI does
        return values[whole.group(1)]
    return _REFERENCE.sub(lambda m: str(values[m.group(1)]) if m.group(1) in values else m.group(0), value)


def resolve_bundle(root: Path, target: str, variables: Mapping[str, str] | None = None,
                   environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The bundle at ``root`` for ``target`` with its variables substituted. ``variables`` are ``--var``
    assignments, ``environ`` is where ``BUNDLE_VAR_<name>`` is looked up, then the target's
    variable-overrides.json, the target's ``variables`` and the default. Workspace references
    (``${workspace.current_user.short_name}``, ``${workspace.file_path}``) get :data:`WORKSPACE`'s
    placeholders; ``${bundle.name}`` and ``${bundle.target}`` their values."""
    bundle = yaml.safe_load((root / "databricks.yml").read_text())
    for pattern in bundle.get("include", []):
        for path in sorted(root.glob(pattern)):
            _merge(bundle, yaml.safe_load(path.read_text()) or {}, path.relative_to(root).as_posix())
    targets = bundle.get("targets") or {}
    if target not in targets:
        raise BundleError(f"target {target!r} is not defined (targets: {', '.join(targets)})")
    chosen = targets[target] or {}
    declared: dict[str, Any] = bundle.get("variables") or {}
    for name in chosen.get("variables") or {}:
        if name not in declared:
            raise BundleError(f"variable {name} is assigned in targets.{target}.variables but not declared under "
                              "variables")
    for name in variables or {}:
        if name not in declared:
            raise BundleError(f'--var="{name}=..." assigns a variable that is not declared under variables')
    for reference, where in _references({k: v for k, v in bundle.items() if k != "targets"} | {"target": chosen}):
        if reference.startswith("var.") and reference[4:] not in declared:
            raise BundleError(f"${{{reference}}} is referenced at {where} but variable {reference[4:]} is not "
                              "declared under variables")
    environ = environ or {}
    overrides_file = root / _OVERRIDES.format(target=target)
    overrides = json.loads(overrides_file.read_text()) if overrides_file.is_file() else {}
    values: dict[str, Any] = {}
    for name, spec in declared.items():
        spec = spec or {}
        if (variables or {}).get(name) is not None:
            values[name] = variables[name]  # type: ignore[index]
        elif environ.get(f"BUNDLE_VAR_{name}") is not None:
            values[name] = environ[f"BUNDLE_VAR_{name}"]
        elif overrides.get(name) is not None:
            values[name] = overrides[name]
        elif name in (chosen.get("variables") or {}):
            values[name] = chosen["variables"][name]
        elif "default" in spec:
            values[name] = spec["default"]
        else:
            raise BundleError(f"no value assigned to required variable {name} in target {target}. Variables are "
                              "usually assigned in databricks.yml, and they can be overridden using "
                              f'--var="{name}=<value>", the BUNDLE_VAR_{name} environment variable, or '
                              f"{_OVERRIDES.format(target=target)}")
    context = {"bundle.name": bundle["bundle"]["name"], "bundle.target": target,
               **{k: v.format(target=target) for k, v in WORKSPACE.items()}}
    resolved_vars = {f"var.{k}": _substitute(v, context) for k, v in values.items()}
    body = {k: v for k, v in bundle.items() if k not in ("targets", "variables")}
    for key in ("workspace", "presets", "artifacts", "sync", "resources"):
        if key in chosen:
            body.setdefault(key, {})
            _merge(body[key], chosen[key], f"targets.{target}.{key}", override=True)
    for key in ("run_as", "permissions"):  # a target's replaces the bundle's
        if key in chosen:
            body[key] = copy.deepcopy(chosen[key])
    out: dict[str, Any] = _substitute(body, {**context, **resolved_vars})
    out["mode"] = chosen.get("mode")
    _apply_identity(out, target)
    return out


#: the bundle's permission levels and the job permission each becomes (the CLI's apply_bundle_permissions)
_JOB_LEVELS = {"CAN_VIEW": "CAN_VIEW", "CAN_RUN": "CAN_MANAGE_RUN", "CAN_MANAGE": "CAN_MANAGE"}
_PRINCIPALS = ("user_name", "group_name", "service_principal_name")


def _principal(entry: Mapping[str, Any], where: str, allowed: tuple[str, ...] = _PRINCIPALS) -> str:
    named = [key for key in _PRINCIPALS if entry.get(key) not in (None, "")]
    if len(named) != 1 or named[0] not in allowed:
        raise BundleError(f"{where} must name exactly one of {', '.join(allowed)}, got {dict(entry)}")
    return named[0]


def _apply_identity(bundle: dict[str, Any], target: str) -> None:
    """What the CLI does with the bundle's ``run_as`` and ``permissions``: each job runs as ``run_as`` (unless it
    names its own), and gets each permission at its job level; a permission or identity naming no one (a variable
    left empty) or a level the bundle does not have is refused."""
    jobs = bundle["resources"]["jobs"]
    run_as = bundle.get("run_as")
    if run_as is not None:
        _principal(run_as, f"targets.{target}.run_as", ("user_name", "service_principal_name"))
    permissions = bundle.get("permissions") or []
    for i, permission in enumerate(permissions):
        _principal(permission, f"targets.{target}.permissions[{i}]")
        if permission.get("level") not in _JOB_LEVELS:
            raise BundleError(f"targets.{target}.permissions[{i}].level must be one of {', '.join(_JOB_LEVELS)}, "
                              f"got {permission.get('level')!r}")
    for job in jobs.values():
        if run_as is not None:
            job.setdefault("run_as", copy.deepcopy(run_as))
        job["permissions"] = [*job.get("permissions", []),
                              *({**p, "level": _JOB_LEVELS[p["level"]]} for p in permissions)]


def deployed_pause_status(bundle: Mapping[str, Any], trigger: Any) -> str:
    """The pause status the CLI deploys a job's schedule or continuous trigger with: development mode (its
    preset trigger_pause_status: PAUSED) pauses every trigger not explicitly UNPAUSED; otherwise the status
    given, and UNPAUSED when none is (the Jobs API's default)."""
    given = getattr(trigger.pause_status, "value", trigger.pause_status)
    paused = (bundle.get("presets") or {}).get("trigger_pause_status",
                                              "PAUSED" if bundle["mode"] == "development" else None)
    if paused == "PAUSED" and given != "UNPAUSED":
        return "PAUSED"
    return given or "UNPAUSED"


def jobs_of(bundle: Mapping[str, Any]) -> dict[str, Job]:
    """The bundle's job resources loaded with databricks-bundles (ValueError on an unknown field or type)."""
    return {name: Job.from_dict(spec) for name, spec in bundle["resources"]["jobs"].items()}


def cluster_environment(job: Job, secrets: Mapping[tuple[str, str], str]) -> dict[str, str]:
    """The environment variables of the job's cluster, ``{{secrets/scope/key}}`` replaced from ``secrets``."""
    [cluster] = job.job_clusters
    assert cluster.new_cluster is not None
    env: dict[str, str] = {}
    for name, value in cluster.new_cluster.spark_env_vars.items():
        found = _SECRET.match(str(value))
        env[name] = secrets[(found.group(1), found.group(2))] if found else str(value)
    return env


PRIMARY = "Endpoint=sb://primary.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey=cHJpbWFyeQ=="
SECONDARY = "Endpoint=sb://secondary.servicebus.windows.net/;SharedAccessKeyName=send;SharedAccessKey=c2Vjb25k"
SECRETS = {("spark-sb", "sb-primary"): PRIMARY, ("spark-sb", "sb-secondary"): SECONDARY}


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_wheel(tmp_path_factory.getbasetemp() / "spark-sb-wheel")


@pytest.mark.parametrize("target", TARGETS)
def test_the_job_resources_load_with_databricks_bundles_for_each_target(target: str) -> None:
    bundle = resolve_bundle(ROOT, target, PROD if target == "prod" else None)
    jobs = jobs_of(bundle)
    assert set(jobs) == {"paired_writer", "syphon"}
    assert bundle["mode"] == ("development" if target == "dev" else "production")
    for name, job in jobs.items():
        [task] = job.tasks
        assert task.python_wheel_task is not None, f"{name}: a python_wheel_task"
        assert task.python_wheel_task.package_name == "spark_sb"
        assert [lib.whl for lib in task.libraries] == ["../dist/*.whl"], f"{name}: the wheel as its library"
        assert task.job_cluster_key == job.job_clusters[0].job_cluster_key
        assert not [r for r, _ in _references(job.as_dict()) if r.startswith("var.")], f"{name}: all substituted"
    assert jobs["syphon"].tasks[0].python_wheel_task.parameters[-1] == "--until-empty"  # type: ignore[union-attr]


def test_the_wheel_artifact_is_built_where_the_jobs_take_it_from() -> None:
    bundle = resolve_bundle(ROOT, "dev")
    [artifact] = bundle["artifacts"].values()
    assert artifact["type"] == "whl" and artifact["path"] == "."
    assert "--wheel-dir dist" in artifact["build"] and "--no-deps" in artifact["build"]
    for path in sorted((ROOT / "resources").glob("*.yml")):
        for job in (yaml.safe_load(path.read_text())["resources"]["jobs"] or {}).values():
            for task in job["tasks"]:
                for library in task["libraries"]:  # relative to the file that names it
                    assert (path.parent / library["whl"]).resolve().parent == ROOT / "dist"


def test_every_entry_point_the_bundle_names_is_in_the_built_wheel_and_callable(wheel: Path) -> None:
    points = wheel_entry_points(wheel)
    named = {job.tasks[0].python_wheel_task.entry_point  # type: ignore[union-attr]
             for job in jobs_of(resolve_bundle(ROOT, "dev")).values()}
    assert named == {"spark-sb-writer", "spark-sb-syphon"}
    for entry_point in named:
        assert entry_point in points, f"{entry_point} is not an entry point of {wheel.name}: {sorted(points)}"
        assert callable(resolve(points[entry_point]))
        assert points[entry_point].startswith("spark_sb."), "package_name spark_sb holds it"


#: what the Databricks runtime brings itself (Spark, Delta) and what only the local emulator needs
_NOT_ON_THE_CLUSTER = {"pyspark", "delta-spark", "python-qpid-proton", "cryptography", "pyjwt"}


@pytest.mark.parametrize("target", TARGETS)
def test_the_jobs_install_the_wheel_without_extras_and_it_brings_no_spark_delta_or_emulator(
        target: str, wheel: Path) -> None:
    """The runtime's own pyspark and Delta stay untouched: the jobs' one library is the wheel, with no extra and no
    other package, and what it requires without extras names neither them nor the emulator's dependencies."""
    for name, job in jobs_of(resolve_bundle(ROOT, target, PROD)).items():
        [task] = job.tasks
        assert [library.as_dict() for library in task.libraries] == [{"whl": "../dist/*.whl"}], name
        assert not job.environments, f"{name}: no job environment installs other packages"
    requires = wheel_requires(wheel)
    assert requires[None] and not requires[None] & _NOT_ON_THE_CLUSTER, sorted(requires[None])
    assert _NOT_ON_THE_CLUSTER <= requires["spark"] | requires["emulator"], "the extras still name them"


@pytest.mark.parametrize(("target", "catalog", "schema"), [("dev", "main", "spark_sb_jane_doe"),
                                                           ("prod", "sales", "spark_sb")])
def test_the_configuration_the_jobs_name_parses_in_their_cluster_environment(
        target: str, catalog: str, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = jobs_of(resolve_bundle(ROOT, target, {**PROD, "catalog": catalog} if target == "prod" else None))
    for name, job in jobs.items():
        parameters = job.tasks[0].python_wheel_task.parameters  # type: ignore[union-attr]
        conf = parameters[parameters.index("--conf") + 1]
        files = WORKSPACE["workspace.file_path"].format(target=target)
        assert conf.startswith(files + "/"), f"{name}: --conf names a file the bundle uploads"
        local = ROOT / conf[len(files) + 1:]
        assert local.is_file(), f"{name}: {local} is not in the bundle"
        env = cluster_environment(job, SECRETS)
        for variable in env:
            monkeypatch.setenv(variable, env[variable])
        config = load_config(local)
        assert config.primary.connection_string is not None
        assert config.primary.connection_string.host == "primary.servicebus.windows.net"
        assert config.secondary.connection_string is not None
        assert config.secondary.connection_string.host == "secondary.servicebus.windows.net"
        assert config.syphon.ledger == f"{catalog}.{schema}.syphon_ledger" and not config.syphon.ledger_is_path
        volume = f"/Volumes/{catalog}/{schema}/spark_sb"
        assert config.syphon.checkpoint_location == f"{volume}/checkpoints/syphon"
        assert config.sink.checkpoint_location == f"{volume}/checkpoints/paired-writer"
        assert config.sink.source.table == f"{catalog}.{schema}.outbox"
        config.syphon.require_job_locations()
        # the cluster sets exactly the environment variables the file's values reference
        referenced = {r for r, _ in _references(yaml.safe_load(local.read_text()))}
        assert referenced == set(env), f"{name}: referenced {sorted(referenced)}, set {sorted(env)}"


def test_the_connection_strings_come_from_the_secret_scope_variable() -> None:
    bundle = resolve_bundle(ROOT, "dev", {"secret_scope": "payments"})
    for job in jobs_of(bundle).values():
        env = job.job_clusters[0].new_cluster.spark_env_vars  # type: ignore[union-attr]
        assert env["SB_PRIMARY"] == "{{secrets/payments/sb-primary}}"
        assert env["SB_SECONDARY"] == "{{secrets/payments/sb-secondary}}"


def test_the_configuration_names_the_connection_string_variable_when_it_is_unset(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("SB_PRIMARY", "SB_SECONDARY", "SB_ENTITY", "SB_SOURCE_TABLE", "SB_LEDGER_TABLE", "SB_VOLUME"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError) as caught:
        load_config(ROOT / "conf" / "databricks.yaml")
    assert "SB_PRIMARY" in str(caught.value) and "primary.connection_string" in str(caught.value)


def test_variables_are_taken_as_the_cli_takes_them() -> None:
    assert jobs_of(resolve_bundle(ROOT, "prod", PROD))["syphon"].job_clusters[0].new_cluster \
        .spark_env_vars["SB_LEDGER_TABLE"] == "sales.spark_sb.syphon_ledger"  # type: ignore[union-attr]
    from_env = resolve_bundle(ROOT, "prod", environ={**{f"BUNDLE_VAR_{k}": v for k, v in PROD.items()},
                                                     "BUNDLE_VAR_catalog": "ops", "BUNDLE_VAR_num_workers": "4"})
    cluster = jobs_of(from_env)["paired_writer"].job_clusters[0].new_cluster
    assert cluster is not None and cluster.num_workers == 4
    assert cluster.spark_env_vars["SB_VOLUME"] == "/Volumes/ops/spark_sb/spark_sb"
    over = resolve_bundle(ROOT, "dev", {"catalog": "flag"}, environ={"BUNDLE_VAR_catalog": "env"})
    assert jobs_of(over)["syphon"].job_clusters[0].new_cluster.spark_env_vars[  # type: ignore[union-attr]
        "SB_SOURCE_TABLE"] == "flag.spark_sb_jane_doe.outbox"


def test_prod_without_a_catalog_is_refused_naming_the_variable() -> None:
    with pytest.raises(BundleError, match=r"no value assigned to required variable catalog in target prod\..*"
                                          r"--var=\"catalog=<value>\", the BUNDLE_VAR_catalog environment variable"):
        resolve_bundle(ROOT, "prod")


def _copy(tmp_path: Path) -> Path:
    shutil.copy2(ROOT / "databricks.yml", tmp_path / "databricks.yml")
    shutil.copytree(ROOT / "resources", tmp_path / "resources")
    return tmp_path


def test_a_variable_left_unset_in_a_broken_copy_is_named(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    text = (root / "databricks.yml").read_text()
    broken = text.replace("    default: Standard_D4ds_v5\n", "")
    assert broken != text
    (root / "databricks.yml").write_text(broken)
    for target in TARGETS:
        with pytest.raises(BundleError, match=f"no value assigned to required variable node_type_id in target {target}"):
            resolve_bundle(root, target, PROD if target == "prod" else {"catalog": "sales"})
    assert jobs_of(resolve_bundle(root, "dev", {"node_type_id": "Standard_E4ds_v5"}))["syphon"] \
        .job_clusters[0].new_cluster.node_type_id == "Standard_E4ds_v5"  # type: ignore[union-attr]


def test_a_variable_referenced_but_not_declared_in_a_broken_copy_is_named(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    job = root / "resources" / "syphon.job.yml"
    job.write_text(job.read_text().replace("${var.node_type_id}", "${var.node_type}"))
    with pytest.raises(BundleError, match=r"\$\{var.node_type\} is referenced at resources.jobs.syphon.job_clusters"
                                          r"\[0\].new_cluster.node_type_id but variable node_type is not declared"):
        resolve_bundle(root, "dev")


def test_an_unknown_job_field_in_a_broken_copy_is_refused_by_databricks_bundles(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    job = root / "resources" / "paired_writer.job.yml"
    job.write_text(job.read_text().replace("python_wheel_task:", "python_wheel_tsk:"))
    with pytest.raises(ValueError, match="Unexpected field 'python_wheel_tsk'"):
        jobs_of(resolve_bundle(root, "dev"))


# the keys the CLI's schema allows (databricks/cli bundle/schema/jsonschema.json: the root, config.Target,
# config.Artifact, config.Sync, config.Presets and variable.Variable; each refuses other keys)
_ALLOWED = {
    "root": {"artifacts", "bundle", "experimental", "include", "permissions", "presets", "python", "resources",
             "run_as", "scripts", "sync", "targets", "variables", "workspace"},
    "target": {"artifacts", "bundle", "cluster_id", "compute_id", "default", "git", "mode", "permissions", "presets",
               "resources", "run_as", "sync", "variables", "workspace"},
    "artifact": {"build", "dynamic_version", "executable", "files", "path", "type"},
    "sync": {"exclude", "include", "paths"},
    "presets": {"artifacts_dynamic_version", "jobs_max_concurrent_runs", "name_prefix", "pipelines_development",
                "source_linked_deployment", "tags", "trigger_pause_status"},
    "variable": {"default", "description", "lookup", "type"},
}


def test_databricks_yml_uses_only_keys_the_cli_knows() -> None:
    bundle = yaml.safe_load((ROOT / "databricks.yml").read_text())
    assert set(bundle) <= _ALLOWED["root"]
    assert set(bundle["sync"]) <= _ALLOWED["sync"]
    for artifact in bundle["artifacts"].values():
        assert set(artifact) <= _ALLOWED["artifact"]
    for name, variable in bundle["variables"].items():
        assert set(variable) <= _ALLOWED["variable"] and variable.get("description"), name
    for name, target in bundle["targets"].items():
        assert set(target) <= _ALLOWED["target"], name
        assert target["mode"] in ("development", "production")
        if target["mode"] == "production":  # the CLI refuses a production target without an explicit root_path
            assert target["workspace"]["root_path"].endswith("/.bundle/${bundle.name}/${bundle.target}"), name
        assert set(target.get("presets") or {}) <= _ALLOWED["presets"], name
    assert [name for name, target in bundle["targets"].items() if target.get("default")] == ["dev"]
    for path in sorted((ROOT / "resources").glob("*.yml")):
        assert set(yaml.safe_load(path.read_text())) == {"resources"}, path.name


def test_a_variable_overrides_file_comes_after_bundle_var_and_before_the_target(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    overrides = root / _OVERRIDES.format(target="prod")
    overrides.parent.mkdir(parents=True)
    overrides.write_text(json.dumps({**PROD, "catalog": "from_file", "schema": "orders"}))
    env = jobs_of(resolve_bundle(root, "prod"))["syphon"].job_clusters[0].new_cluster.spark_env_vars  # type: ignore[union-attr]
    assert env["SB_LEDGER_TABLE"] == "from_file.orders.syphon_ledger"
    env = jobs_of(resolve_bundle(root, "prod", environ={"BUNDLE_VAR_catalog": "from_env"}))["syphon"] \
        .job_clusters[0].new_cluster.spark_env_vars  # type: ignore[union-attr]
    assert env["SB_LEDGER_TABLE"] == "from_env.orders.syphon_ledger"


@pytest.mark.parametrize("target", TARGETS)
def test_the_writer_job_is_continuous_and_paused_only_in_dev(target: str) -> None:
    """A continuous job: Databricks keeps one run of the streaming writer going and starts the next after a run
    fails or ends (task retries would give up after their count). dev mode deploys it paused (run it with
    `bundle run`); prod deploys it explicitly UNPAUSED. The syphon stays scheduled, paused in dev."""
    bundle = resolve_bundle(ROOT, target, PROD if target == "prod" else None)
    jobs = jobs_of(bundle)
    writer, syphon = jobs["paired_writer"], jobs["syphon"]
    assert writer.continuous is not None and writer.schedule is None and writer.max_concurrent_runs == 1
    assert not writer.tasks[0].max_retries, "a continuous job's run is restarted by Databricks, not retried"
    assert syphon.continuous is None and syphon.schedule is not None
    expected = "PAUSED" if target == "dev" else "UNPAUSED"
    assert deployed_pause_status(bundle, writer.continuous) == expected
    assert deployed_pause_status(bundle, syphon.schedule) == expected


@pytest.mark.parametrize("target", TARGETS)
def test_both_job_clusters_keep_the_driver_on_demand_and_run_no_speculative_copies(target: str) -> None:
    """A spot node taken back must not be the driver (first_on_demand 1), and neither job runs speculative copies
    of its tasks (docs/guarantee.md, On a cluster); the workers' availability is the ``availability`` variable."""
    bundle = resolve_bundle(ROOT, target, {**(PROD if target == "prod" else {}),
                                           "availability": "SPOT_WITH_FALLBACK_AZURE"})
    for name, job in jobs_of(bundle).items():
        cluster = job.job_clusters[0].new_cluster
        assert cluster.azure_attributes is not None, name
        assert cluster.azure_attributes.first_on_demand == 1, name
        assert str(cluster.azure_attributes.availability.value) == "SPOT_WITH_FALLBACK_AZURE", name
        assert cluster.spark_conf == {"spark.speculation": "false"}, name


@pytest.mark.parametrize("target", TARGETS)
def test_both_jobs_email_on_failure_and_not_on_a_cancelled_run(target: str) -> None:
    jobs = jobs_of(resolve_bundle(ROOT, target, PROD if target == "prod" else None))
    expected = PROD["alert_email"] if target == "prod" else WORKSPACE["workspace.current_user.userName"]
    for name, job in jobs.items():
        assert job.email_notifications is not None and job.email_notifications.on_failure == [expected], name
        assert job.notification_settings is not None and job.notification_settings.no_alert_for_canceled_runs, name


def test_prod_runs_as_its_service_principal_with_permissions_and_dev_as_the_deploying_user() -> None:
    for name, job in jobs_of(resolve_bundle(ROOT, "prod", PROD)).items():
        assert job.run_as is not None and job.run_as.service_principal_name == PROD["service_principal"], name
        assert job.run_as.user_name is None
        granted = {(p.level.value if hasattr(p.level, "value") else p.level,  # type: ignore[union-attr]
                    p.group_name or p.service_principal_name or p.user_name) for p in job.permissions}
        assert granted == {("CAN_MANAGE", PROD["operators_group"]), ("CAN_VIEW", PROD["service_principal"]),
                           ("CAN_VIEW", "users")}, name
    for name, job in jobs_of(resolve_bundle(ROOT, "dev")).items():
        assert job.run_as is None and not job.permissions, name


@pytest.mark.parametrize("variable", ["alert_email", "service_principal", "operators_group"])
def test_prod_without_one_of_its_production_variables_is_refused_naming_it(variable: str) -> None:
    with pytest.raises(BundleError, match=f"no value assigned to required variable {variable} in target prod"):
        resolve_bundle(ROOT, "prod", {k: v for k, v in PROD.items() if k != variable})


@pytest.mark.parametrize(("variable", "where"), [("service_principal", r"run_as"),
                                                 ("operators_group", r"permissions\[0\]")])
def test_a_production_identity_left_empty_is_refused_naming_where(variable: str, where: str) -> None:
    with pytest.raises(BundleError, match=rf"targets\.prod\.{where} must name exactly one of"):
        resolve_bundle(ROOT, "prod", {**PROD, variable: ""})


def test_a_permission_level_the_bundle_does_not_have_is_refused_in_a_broken_copy(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    text = (root / "databricks.yml").read_text()
    (root / "databricks.yml").write_text(text.replace("level: CAN_MANAGE", "level: CAN_EDIT"))
    with pytest.raises(BundleError, match=r"targets.prod.permissions\[0\].level must be one of CAN_VIEW, CAN_RUN, "
                                          r"CAN_MANAGE, got 'CAN_EDIT'"):
        resolve_bundle(root, "prod", PROD)
