"""Loading and validating the pipeline configuration.

The JSON Schema ``workflow/schemas/config.schema.yaml`` is the single description of every key,
its default and its allowed range. :func:`validate_config` applies it (filling defaults, as
``snakemake.utils.validate`` does) and then checks the rules that span several keys. Both the
Snakefile and every ``cosmoflow`` entry point go through it, so an invalid configuration fails
before any work starts, with one sentence naming the key, the value and what is allowed.
"""

from __future__ import annotations

import copy
import functools
import math
import re
from pathlib import Path
from typing import Sequence

import jsonschema
import yaml

from workflow.errors import ConfigError

SCHEMA_PATH = Path(__file__).parent / "schemas" / "config.schema.yaml"
DEFAULT_CONFIG_PATH = Path("config/config.yaml")
REQUIRED_PARAMETERS = ("Omega_m", "sigma_8", "n_s")
# What pyCOLA (simulation.backend: pycola, PyPI pycola3 0.0.7) can take; the reasons are in
# simulations/pycola_backend.py, which applies the same limits to direct calls.
PYCOLA_MAX_MESH = 2048  # mesh cells per side: its float32 edge clip fails above
PYCOLA_MIN_PLANES_PER_THREAD = 4  # lattice planes per OpenMP chunk
PYCOLA_MAX_Z_INIT = 999.0  # its growth table starts at a = 0.001
# Keys that configurations written for earlier versions may hold, each with what became of it.
RETIRED_KEYS = {
    "simulation.batch_size": "was renamed 'simulation.sims_per_job' (simulations per job; "
                             "training.batch_size is samples per step)",
    "simulation.gradient": "was removed: the force is always the four-point finite difference of "
                           "the potential (simulations/cola.py); delete the key",
    "training.test_only_straggler_delay_s": "was removed: tests and benchmarks slow the last rank "
                                            "with the environment variable "
                                            "COSMOFLOW_STRAGGLER_DELAY_S (training/settings.py)",
}


class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """PyYAML's safe loader, also reading ``1e-3`` as a number (YAML 1.2 does; PyYAML, following
    YAML 1.1, would read a string and the schema would refuse it)."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)?(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def read_yaml(text: str):
    """Parse YAML text with :class:`_Loader`."""
    return yaml.load(text, Loader=_Loader)


def load_schema() -> dict:
    """The configuration schema (a fresh copy: callers may modify it)."""
    return copy.deepcopy(_schema())


@functools.cache
def _schema() -> dict:
    return read_yaml(SCHEMA_PATH.read_text(encoding="utf-8"))


def _subschema(key: str) -> dict:
    """The schema of the dotted config ``key`` (e.g. 'simulation.gradient')."""
    schema = _schema()
    for part in key.split("."):
        schema = schema["properties"][part]
    return schema


def schema_enum(key: str) -> tuple:
    """The allowed values of the dotted config ``key``, as the schema lists them."""
    schema = _subschema(key)
    return tuple(schema.get("enum") or schema["items"]["enum"])


def schema_keys(key: str) -> tuple[str, ...]:
    """The keys of the config section ``key`` (e.g. 'sampling.splits': train, val, test)."""
    return tuple(_subschema(key)["properties"])


SPLITS = schema_keys("sampling.splits")  # train, val, test: the splits of every data set


def load_config(path: str | Path = DEFAULT_CONFIG_PATH, overrides: Sequence[str] = ()) -> dict:
    """Read a YAML configuration file, apply ``overrides`` (``KEY=VALUE``, see
    :func:`set_keys`) and return it validated, with defaults filled in."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    try:
        data = read_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    source = " + ".join([str(path)] + [f"--set {item}" for item in overrides])
    return validate_config(set_keys(data, overrides), source=source)


def set_keys(data: dict, assignments: Sequence[str]) -> dict:
    """A copy of ``data`` with each ``KEY=VALUE`` of ``assignments`` set: KEY dotted
    (``training.learning_rate``), VALUE read as YAML (``1e-3``, ``[0.0, 1.0]``, ``null``)."""
    data = copy.deepcopy(data)
    for assignment in assignments:
        key, equals, text = assignment.partition("=")
        if not equals or not key:
            raise ConfigError(f"--set {assignment!r} is not KEY=VALUE (e.g. training.learning_rate=1e-3)")
        try:
            value = read_yaml(text)
        except yaml.YAMLError as error:
            raise ConfigError(f"--set {assignment!r}: {text!r} is not a YAML value ({error})") from None
        *parents, leaf = key.split(".")
        section = data
        for part in parents:
            section = section.setdefault(part, {})
            if not isinstance(section, dict):
                raise ConfigError(f"--set {assignment!r}: '{part}' is not a section of the configuration")
        section[leaf] = value
    return data


def _validator_with_defaults(schema: dict):
    """A JSON Schema validator that fills in ``default`` values (jsonschema FAQ recipe)."""
    base = jsonschema.validators.validator_for(schema)
    validate_properties = base.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, subschema):
        if isinstance(instance, dict):
            for name, prop in properties.items():
                if "default" in prop:
                    instance.setdefault(name, copy.deepcopy(prop["default"]))
        yield from validate_properties(validator, properties, instance, subschema)

    return jsonschema.validators.extend(base, {"properties": set_defaults})(schema)


def _key_path(path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<top level>"


def _description(schema: dict, path) -> str | None:
    """The description of the key at ``path``, or of the nearest enclosing key that has one."""
    found = schema.get("description")
    for part in path:
        schema = (schema.get("items", {}) if isinstance(part, int)
                  else schema.get("properties", {}).get(part, {}))
        found = schema.get("description", found)
    return found


def _describe(error: jsonschema.ValidationError, schema: dict) -> str:
    """Turn a schema violation into one sentence naming key, value and what is allowed."""
    key = _key_path(error.absolute_path)
    value = error.instance
    rule = error.validator
    if rule == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        unknown = sorted(set(value) - set(allowed))
        where = f"in '{key}'" if error.absolute_path else "at the top level"
        return f"unknown key {', '.join(map(repr, unknown))} {where}; allowed keys: {', '.join(allowed)}"
    if rule == "enum":
        allowed = ", ".join(map(str, error.validator_value))
        return f"key '{key}' = {value!r} is not allowed; choose one of: {allowed}"
    bounds = {
        "minimum": "at least", "maximum": "at most",
        "exclusiveMinimum": "greater than", "exclusiveMaximum": "less than",
    }
    if rule in bounds:
        text = f"key '{key}' = {value!r} is out of range; it must be {bounds[rule]} {error.validator_value}"
        description = _description(schema, error.absolute_path)
        return text + (f" ({description})" if description else "")
    if rule == "type":
        return f"key '{key}' = {value!r} must be of type {error.validator_value}"
    if rule == "not":
        description = _description(schema, error.absolute_path)
        return f"key '{key}' = {value!r} is not allowed" + (f" ({description})" if description else "")
    return f"key '{key}' = {value!r} is invalid: {error.message}"


def validate_config(config: dict, source: str = "config") -> dict:
    """Return a validated copy of ``config`` with every default filled in.

    Raises :class:`ConfigError` naming ``source``, the key, the value and what is allowed.
    """
    config = copy.deepcopy(config)
    retired = [f"key '{key}' {fate}" for key, fate in RETIRED_KEYS.items() if _holds(config, key)]
    if retired:
        raise ConfigError(f"invalid configuration {source}: " + "; ".join(retired))
    schema = _schema()
    errors = sorted(
        _validator_with_defaults(schema).iter_errors(config), key=lambda e: list(map(str, e.absolute_path))
    )
    if errors:
        raise ConfigError(
            f"invalid configuration {source}: " + "; ".join(_describe(error, schema) for error in errors)
        )
    problems = _cross_key_problems(config, schema)
    if problems:
        raise ConfigError(f"invalid configuration {source}: " + "; ".join(problems))
    return config


def _holds(config: dict, key: str) -> bool:
    """Whether ``config`` sets the dotted ``key``."""
    *parents, leaf = key.split(".")
    for part in parents:
        config = config.get(part)
        if not isinstance(config, dict):
            return False
    return leaf in config


def _cross_key_problems(config: dict, schema: dict) -> list[str]:
    """Rules spanning several keys, which JSON Schema cannot state clearly."""
    problems = []
    sampling = config["sampling"]
    names = sampling["parameters"]
    missing = [name for name in REQUIRED_PARAMETERS if name not in names]
    if missing:
        problems.append(
            f"key 'sampling.parameters' = {names} must include {', '.join(missing)} "
            f"(Omega_m, sigma_8 and n_s are always sampled; h is optional)"
        )
    for name in names:
        low, high = sampling["ranges"][name]
        if not low < high:
            problems.append(f"key 'sampling.ranges.{name}' = [{low}, {high}] must have min < max")
    omega_b = config["cosmology"]["Omega_b"]
    lowest_omega_m = sampling["ranges"]["Omega_m"][0]
    if sampling["design"] == "fiducial_derivatives":
        lowest_omega_m = sampling["fiducial"]["Omega_m"] - sampling["derivative_steps"]["Omega_m"]
    if omega_b >= lowest_omega_m:
        problems.append(
            f"key 'cosmology.Omega_b' = {omega_b} must be below the smallest sampled Omega_m "
            f"({lowest_omega_m})"
        )
    problems += _simulation_problems(config)
    problems += _training_problems(config["training"])
    problems += _design_problems(sampling, schema)
    problems += _split_problems(sampling)
    training = config["training"]
    if training["validation_split"] == training["train_split"]:
        problems.append(
            f"key 'training.validation_split' = {training['validation_split']!r} is also "
            f"'training.train_split'; choose another split or null (no validation)"
        )

    problems += _subset_problems(config)
    problems += _analysis_problems(config)
    problems += _parsl_problems(config)

    preprocessing = config["preprocessing"]
    grid, subvolume = preprocessing["grid"], preprocessing["subvolume"]
    if grid % subvolume:
        problems.append(
            f"key 'preprocessing.subvolume' = {subvolume} does not divide 'preprocessing.grid' = {grid}; "
            f"allowed: a divisor of {grid} such as {grid // 2}"
        )
    if preprocessing["assignment"] == "cic" and preprocessing["dtype"] != "float32":
        problems.append(
            f"key 'preprocessing.dtype' = {preprocessing['dtype']!r} cannot hold the fractional "
            f"counts of 'preprocessing.assignment' = 'cic'; use float32"
        )
    return problems


def shard_size(n_subvolumes: int, samples_per_file: int, sims_per_shard: int) -> int:
    """Simulations in each full write_tfrecords shard: sims_per_shard rounded up so that the
    shard's samples (n_subvolumes per simulation) fill whole files of samples_per_file."""
    sims_per_whole_file = samples_per_file // math.gcd(samples_per_file, n_subvolumes)
    return -(-sims_per_shard // sims_per_whole_file) * sims_per_whole_file


def _subset_problems(config: dict) -> list[str]:
    """Every training subset, training.train_fraction and each fraction of
    analysis.learning_curve, is whole TFRecord files: the first round(fraction x simulations) of
    the training split (Manifest.subset, which checks the data set itself when training starts)
    must be whole shards, or all of them."""
    pre, training = config["preprocessing"], config["training"]
    size = shard_size((pre["grid"] // pre["subvolume"]) ** 3, pre["samples_per_file"],
                      pre["sims_per_shard"])
    split = training["train_split"]
    total = split_counts(config["sampling"]["n_simulations"], config["sampling"]["splits"])[split]
    fractions = [("training.train_fraction", training["train_fraction"])] * (training["train_fraction"] < 1)
    fractions += [("analysis.learning_curve", fraction) for fraction in config["analysis"]["learning_curve"]]
    problems = []
    for key, fraction in fractions:
        count = round(fraction * total)
        if count == 0 or (count % size and count != total):
            problems.append(
                f"key '{key}' = {fraction:g} selects {count} of the {total} training simulations, "
                f"not a positive multiple of the {size} simulations of each TFRecord shard "
                f"('preprocessing.sims_per_shard' = {pre['sims_per_shard']}, rounded up to fill "
                f"files of {pre['samples_per_file']} samples) nor all of split {split!r} "
                f"('training.train_split'); choose fractions and shard sizes that agree")
    return problems


def _analysis_problems(config: dict) -> list[str]:
    """The analyze stage's baselines, learning curve and Fisher companion (analysis/jobs.py)."""
    analysis, problems = config["analysis"], []
    baselines, curve = analysis["baselines"], analysis["learning_curve"]
    if baselines and config["training"]["validation_split"] is None:
        problems.append(
            f"key 'analysis.baselines' = {baselines} are chosen on 'training.validation_split', "
            f"which is null; name a split (e.g. val) or set 'analysis.baselines' to []")
    if curve and not {"mean", "ridge"} <= set(baselines):
        problems.append(
            f"key 'analysis.learning_curve' = {curve} refits the ridge baseline on each subset and "
            f"scores it against the mean; 'analysis.baselines' = {baselines} must include mean "
            f"and ridge (or set 'analysis.learning_curve' to [])")
    companion = analysis["fisher_companion"]
    if companion is not None:
        problems += _companion_problems(config, companion)
    return problems


def _companion_problems(config: dict, companion: str) -> list[str]:
    """analysis.fisher_companion names a valid fiducial_derivatives configuration with this run's
    samples: the same sub-volume, voxel size, channels (redshifts) and parameters. Its own
    companion is not read: it is run up to its manifest."""
    key = f"key 'analysis.fisher_companion' = {companion!r}"
    try:
        text = Path(companion).read_text(encoding="utf-8")
    except OSError:
        return [f"{key}: no such configuration file (paths are relative to the working directory)"]
    data = read_yaml(text)
    if not isinstance(data, dict):
        return [f"{key} must hold a mapping of keys"]
    data.setdefault("analysis", {})["fisher_companion"] = None
    try:
        theirs = validate_config(data, source=companion)
    except ConfigError as error:
        return [f"{key} is not valid: {error}"]
    if theirs["sampling"]["design"] != "fiducial_derivatives":
        return [f"{key} is a {theirs['sampling']['design']} run; it must be a fiducial_derivatives run"]

    def samples(run: dict) -> tuple:
        """Sample side (voxels), voxel size (Mpc/h), channels, parameters."""
        pre, simulation = run["preprocessing"], run["simulation"]
        return (pre["subvolume"], simulation["box_size"] / pre["grid"], len(simulation["redshifts"]),
                tuple(run["sampling"]["parameters"]))

    if samples(theirs) != samples(config):
        return [f"{key} makes samples of {{}}^3 voxels of {{:g}} Mpc/h, {{}} channels, parameters "
                f"{{}}; this run's are {{}}^3, {{:g}} Mpc/h, {{}}, {{}}: the companion must have the "
                f"same resolution".format(*samples(theirs), *samples(config))]
    return []


def _training_problems(training: dict) -> list[str]:
    problems = []
    if training["mode"] == "async" and training["checkpoint_every_steps"]:
        problems.append(
            f"key 'training.checkpoint_every_steps' = {training['checkpoint_every_steps']} is not "
            f"supported with 'training.mode' = 'async', which checkpoints at the end of each epoch "
            f"once every update is applied; set it to 0 or use training.mode 'sync'"
        )
    return problems


def _parsl_problems(config: dict) -> list[str]:
    """The Parsl section against itself and the sweep (workflow/parsl/)."""
    problems = []
    parsl, sweep = config["parsl"], config["sweep"]
    if parsl["provider"] == "local":
        if parsl["mpi"]["launcher"] == "srun":
            problems.append("key 'parsl.mpi.launcher' = 'srun' needs 'parsl.provider' = 'slurm'; "
                            "local trials launch with mpiexec")
        for key, value in (("parsl.nodes_per_block", parsl["nodes_per_block"]),
                           ("sweep.nodes", sweep["nodes"])):
            if value > 1:
                problems.append(f"key '{key}' = {value} needs 'parsl.provider' = 'slurm'; "
                                f"a local block is this one machine")
        if parsl["interface"] is not None:
            problems.append(f"key 'parsl.interface' = {parsl['interface']!r} needs "
                            f"'parsl.provider' = 'slurm'; a local run listens on loopback "
                            f"(127.0.0.1) only")
    elif sweep["nodes"] > parsl["nodes_per_block"]:
        problems.append(
            f"key 'sweep.nodes' = {sweep['nodes']} does not fit a block of 'parsl.nodes_per_block' = "
            f"{parsl['nodes_per_block']} (a trial runs inside one block)")
    if sweep["ranks"] % sweep["nodes"]:
        problems.append(f"key 'sweep.ranks' = {sweep['ranks']} is not a multiple of 'sweep.nodes' = "
                        f"{sweep['nodes']} (every node of a trial runs as many ranks)")
    combinations = math.prod(len(values) for values in sweep["space"].values())
    if sweep["search"] == "random" and sweep["trials"] > combinations:
        problems.append(
            f"key 'sweep.trials' = {sweep['trials']} exceeds the {combinations} distinct combinations "
            f"of 'sweep.space'; use at most {combinations} or add values")
    if sweep["enabled"] and config["training"]["validation_split"] is None:
        problems.append("key 'training.validation_split' = None leaves a sweep nothing to rank its "
                        "trials by; name a split or set 'sweep.enabled' to false")
    return problems


def _simulation_problems(config: dict) -> list[str]:
    problems = []
    ics, simulation, cosmology = config["initial_conditions"], config["simulation"], config["cosmology"]
    if ics["z_init"] <= max(simulation["redshifts"]):
        problems.append(
            f"key 'initial_conditions.z_init' = {ics['z_init']} must exceed the highest snapshot "
            f"redshift in 'simulation.redshifts' ({max(simulation['redshifts'])})"
        )
    if simulation["n_particles"] % 2:
        problems.append(
            f"key 'simulation.n_particles' = {simulation['n_particles']} must be even "
            f"(the spectral derivatives drop the Nyquist plane)"
        )
    if cosmology["transfer"] == "table":
        table = cosmology["transfer_table"]
        if not table:
            problems.append("key 'cosmology.transfer_table' must name a file when "
                            "'cosmology.transfer' is 'table'")
        elif not Path(table).is_file():
            problems.append(f"key 'cosmology.transfer_table' = {table!r}: no such file")
    elif cosmology["transfer_table"]:
        problems.append(
            f"key 'cosmology.transfer_table' = {cosmology['transfer_table']!r} is only used with "
            f"'cosmology.transfer' = 'table', not {cosmology['transfer']!r}"
        )
    if simulation["n_steps"] < len(simulation["redshifts"]):
        problems.append(
            f"key 'simulation.n_steps' = {simulation['n_steps']} is fewer than the "
            f"{len(simulation['redshifts'])} snapshot redshifts (each snapshot ends a step)"
        )
    if simulation["backend"] == "pycola":
        problems += _pycola_problems(simulation, ics)
    if ics["backend"] == "music":
        if not ics["music_executable"]:
            problems.append(
                "key 'initial_conditions.music_executable' must name the MUSIC executable when "
                "'initial_conditions.backend' is 'music'"
            )
        if cosmology["transfer"] != "eisenstein_hu":
            problems.append(
                f"key 'cosmology.transfer' = {cosmology['transfer']!r} has no MUSIC equivalent; "
                f"backend 'music' needs 'eisenstein_hu'"
            )
        for key in ("fixed_amplitude", "phase_flip"):
            if ics[key]:
                problems.append(f"key 'initial_conditions.{key}' is not available with backend 'music'")
        n = simulation["n_particles"]
        if n & (n - 1):
            problems.append(
                f"key 'simulation.n_particles' = {n} must be a power of two for MUSIC "
                f"(levelmin = log2 N), e.g. {2 ** round(math.log2(n))}"
            )
    return problems


def _pycola_problems(simulation: dict, ics: dict) -> list[str]:
    """Settings that backend 'pycola' cannot take (simulations/pycola_backend.py)."""
    problems = [
        f"key 'simulation.{key}' = {simulation[key]!r} is not available with "
        f"'simulation.backend' = 'pycola', which needs {key} = {needed!r}"
        for key, needed in (("cola", True), ("stepping", "linear_a")) if simulation[key] != needed
    ]
    n, factor, threads = simulation["n_particles"], simulation["mesh_factor"], simulation["threads"]
    if n * factor > PYCOLA_MAX_MESH:
        problems.append(
            f"key 'simulation.mesh_factor' = {factor} with 'simulation.n_particles' = {n} makes a "
            f"{n * factor}^3 mesh, larger than backend 'pycola' can index ({PYCOLA_MAX_MESH} cells "
            f"per side); allowed: n_particles x mesh_factor <= {PYCOLA_MAX_MESH}"
        )
    if n < PYCOLA_MIN_PLANES_PER_THREAD * threads:
        problems.append(
            f"key 'simulation.threads' = {threads} is too many for backend 'pycola' with "
            f"'simulation.n_particles' = {n} (its OpenMP loops need {PYCOLA_MIN_PLANES_PER_THREAD} "
            f"lattice planes per thread); allowed: at most {max(1, n // PYCOLA_MIN_PLANES_PER_THREAD)}"
        )
    if ics["z_init"] > PYCOLA_MAX_Z_INIT:
        problems.append(
            f"key 'initial_conditions.z_init' = {ics['z_init']} is above {PYCOLA_MAX_Z_INIT:g}, "
            f"the earliest start backend 'pycola' can take (its growth table starts at a = 0.001)"
        )
    return problems


def _design_problems(sampling: dict, schema: dict) -> list[str]:
    n = sampling["n_simulations"]
    d = len(sampling["parameters"])
    design = sampling["design"]
    if design == "grid" and round(n ** (1 / d)) ** d != n:
        near = [m**d for m in (max(1, math.floor(n ** (1 / d))), math.floor(n ** (1 / d)) + 1)]
        return [
            f"key 'sampling.n_simulations' = {n} is not a perfect {d}-th power, as design 'grid' "
            f"with {d} parameters needs; e.g. {near[0]} or {near[1]}"
        ]
    if design == "fiducial_derivatives":
        points = 1 + 2 * d
        problems = []
        if n % points:
            problems.append(
                f"key 'sampling.n_simulations' = {n} is not a multiple of {points} "
                f"(the fiducial point and -/+ steps in {d} parameters) as design 'fiducial_derivatives' needs"
            )
        physical = schema["properties"]["sampling"]["properties"]["ranges"]["properties"]
        for name in sampling["parameters"]:
            centre, step = sampling["fiducial"][name], sampling["derivative_steps"][name]
            low, high = physical[name]["items"]["minimum"], physical[name]["items"]["maximum"]
            if not low <= centre - step < centre + step <= high:
                problems.append(
                    f"key 'sampling.fiducial.{name}' = {centre} with derivative step {step} leaves "
                    f"the physical range [{low}, {high}]"
                )
        return problems
    return []


def _split_problems(sampling: dict) -> list[str]:
    fractions = sampling["splits"]
    total = sum(fractions.values())
    if not math.isclose(total, 1.0, abs_tol=1e-9):
        return [f"key 'sampling.splits' = {fractions} must sum to 1, not {total:g}"]
    counts = split_counts(sampling["n_simulations"], fractions)
    return [
        f"key 'sampling.splits.{split}' = {fractions[split]} gives no simulation out of "
        f"n_simulations = {sampling['n_simulations']}; raise it, or set it to 0"
        for split, count in counts.items()
        if fractions[split] > 0 and count == 0
    ]


def split_counts(n_simulations: int, fractions: dict) -> dict:
    """Simulations per split: val and test get round(n * fraction) (as many as remain), train the rest."""
    val = round(n_simulations * fractions["val"])
    test = min(round(n_simulations * fractions["test"]), n_simulations - val)
    return {"train": n_simulations - val - test, "val": val, "test": test}


def split_samples(config: dict) -> dict:
    """Samples per split: its simulations x (grid/subvolume)^3 sub-volumes each."""
    per_sim = (config["preprocessing"]["grid"] // config["preprocessing"]["subvolume"]) ** 3
    sims = split_counts(config["sampling"]["n_simulations"], config["sampling"]["splits"])
    return {split: n * per_sim for split, n in sims.items()}


def sample_voxels(config: dict) -> int:
    """Values in one sample: subvolume^3 voxels x one channel per snapshot redshift."""
    return config["preprocessing"]["subvolume"] ** 3 * len(config["simulation"]["redshifts"])


def run_directory(config: dict) -> Path:
    """The run directory, ``<results_dir>/<run_name>`` (DESIGN.md, "Run directory")."""
    return Path(config["results_dir"]) / config["run_name"]


def n_batches(config: dict) -> int:
    """Number of simulation batches, the unit of scheduling (simulation.sims_per_job sims each)."""
    return math.ceil(config["sampling"]["n_simulations"] / config["simulation"]["sims_per_job"])


def batch_sim_ids(config: dict, batch: int) -> range:
    """The sim_ids of ``batch``: consecutive, simulation.sims_per_job of them (params.csv)."""
    size = config["simulation"]["sims_per_job"]
    return range(batch * size, min((batch + 1) * size, config["sampling"]["n_simulations"]))


def dump_config(config: dict) -> str:
    """YAML text of a configuration, keys in schema order, for the run directory's record."""
    return yaml.safe_dump(config, sort_keys=False, default_flow_style=None)
