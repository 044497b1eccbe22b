"""pytest hooks for the suite: the markers ``multirank``, ``slow`` and ``gpu`` (registered in
pyproject.toml) are applied here, at collection, from the table below and from what the tests call.
The helpers that launch real jobs live in tests/helpers.py.

``make test`` runs every test whatever its markers; ``make test-quick`` runs
``-m "not multirank and not slow and not gpu"``.

* ``multirank``: the test launches a multi-rank job (horovodrun or mpirun). Found by itself for every
  test that reaches ``tests.helpers.launch`` -- directly, through a helper function of tests/ (such
  as ``digits_checks.run_example``) or through a fixture; listed in MARKERS where a test starts the
  job another way (a benchmark's ``--np``, an elastic horovodrun through ``run_bounded``).
* ``slow``: the test takes over about 20 s on its own (measured with ``pytest --durations=0`` on a
  2-core machine); listed in MARKERS.
* ``gpu``: the test needs a CUDA device (it is skipped where there is none); the parametrized
  cases in GPU_PARAMS.
"""
import inspect
import warnings

import pytest

from tests import helpers
from tests.digits_checks import ACCURACY_ARGS, ACCURACY_NP, run_example

# "module" (every test of tests/<module>.py) or "module::test function" (every parametrization of it)
# -> markers: what the multirank detection below does not find by itself, and the slow tests.
MARKERS = {
    # jobs started without tests.helpers.launch
    "test_elastic": {"multirank", "slow"},                        # horovodrun --min-np/--max-np (elastic)
    "test_tf_elastic": {"multirank", "slow"},                     # the same, TensorFlow
    "test_bench_torch": {"multirank", "slow"},                    # python -m benchmarks torch --np 2
    "test_bench_convergence": {"multirank", "slow"},              # python -m benchmarks convergence --np 2
    "test_bench_lm::test_lm_smoke_reports_what_it_computed": {"multirank", "slow"},  # convergence --workload lm --np 2
    "test_bench_reduction": {"multirank", "slow"},                # python -m benchmarks reduction --np 2 3
    "test_bench_overhead::test_tensorflow_overhead_tiny": {"multirank"},  # overhead --framework tensorflow --np 2
    "test_bench_e2e::test_real_run_counts_bytes_and_cleans_up": {"multirank", "slow"},
    "test_bench_e2e::test_sigterm_kills_ranks_and_deletes_namespaces": {"multirank"},
    "test_diagnose::test_horovods_build_matches_horovodruns_check_build": {"slow"},
    "test_install::test_the_sdist_installs_into_an_existing_environment_and_passes_its_self_test": {"slow"},
    "test_bench_e2e::test_hosts_of_two_ranks_share_a_link_and_hierarchical_spares_it": {"multirank"},
    # slow: seconds measured in a full run on 2 shared cores (quiet-machine seconds in brackets)
    "test_soak": {"slow"},                                        # 120-280 s a test
    "test_demo": {"slow"},                                        # 30-160 s
    "test_algorithms_convergence": {"slow"},                      # 45-90 s
    "test_tf_examples::test_tensorflow2_qsgd_reaches_the_uncompressed_accuracy": {"slow"},  # 94 s
    "test_tf_examples::test_keras3_qsgd4_reaches_the_uncompressed_accuracy": {"slow"},       # 63 s
    "test_tf_compressor::test_tape_allreduce_and_keras_equal_single_process_decode_on_every_rank": {"slow"},  # 22-41 s
    "test_tf_compressor::test_scatter_allgather_equals_the_reduction_simulation_on_every_rank": {"slow"},  # 26-37 s
    "test_multirank::test_horovod_allgather_of_payloads": {"slow"},                          # up to 33 s
    "test_golden_payloads::test_payload_bytes_match_the_recording": {"slow"},                # 29-35 s
    "test_environment::test_horovod_check_build_shows_frameworks_and_controllers": {"slow"},  # 30 s [37 s]
    "test_cuda::test_encode_is_byte_identical_to_cpu": {"slow"},                             # 54 s [37 s] emulated
    "test_robustness::test_round_trip_of_more_than_2_31_elements": {"slow"},                 # 51 s [15 s], > 8 GB
    "test_keras_dropin::test_fit_through_the_dropin_with_every_callback": {"slow"},          # 30-70 s a launch
    "test_dropin::test_torch_optimizer_over_a_process_set_and_with_unused_branches_needs_no_compressor_arguments":
        {"slow"},                                                                            # 25-60 s a launch
    "test_dropin::test_tf_pipeline": {"slow"},                  # 60-120 s, its first case: the launch
    "test_readme_quickstarts::test_the_quickstart_block_runs_as_written_on_two_ranks": {"slow"},  # 25 s + 13 s launches
    "test_sanitizers": {"slow"},                                  # builds the codec sanitized: 80-95 s a test
}
# (module, parameter, value): the parametrized cases that run on a CUDA device
GPU_PARAMS = {("test_cuda", "backend", "gpu"), ("test_cuda", "device", "gpu")}
# what a multi-rank test calls, directly or not
LAUNCHERS = (helpers.launch,)


def _code_names(code):
    """The global and attribute names a code object (and the functions nested in it) uses."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _reaches_launcher(fn, seen):
    """Whether ``fn`` calls a LAUNCHER, directly or through functions defined in tests/."""
    fn = inspect.unwrap(fn)
    if fn in LAUNCHERS:
        return True
    if not inspect.isfunction(fn) or fn in seen or not fn.__module__.startswith("tests"):
        return False
    seen.add(fn)
    names = _code_names(fn.__code__)
    for name in names:
        obj = fn.__globals__.get(name)
        candidates = [obj]
        if inspect.ismodule(obj) and obj.__name__.startswith("tests"):  # digits_checks.run_example
            candidates = [getattr(obj, n, None) for n in names]
        if any(c is not None and _reaches_launcher(c, seen) for c in candidates):
            return True
    return False


def _launches(item):
    seen = set()
    functions = [getattr(item, "function", None)]
    fixture_info = getattr(item, "_fixtureinfo", None)
    for defs in (fixture_info.name2fixturedefs.values() if fixture_info else ()):
        functions += [d.func for d in defs]
    return any(f is not None and _reaches_launcher(f, seen) for f in functions)


def markers_of(item):
    """The names of the markers this table and detection give a collected test."""
    module = item.path.stem
    name = getattr(item, "originalname", item.name)
    marks = set(MARKERS.get(module, ())) | set(MARKERS.get(f"{module}::{name}", ()))
    if "multirank" not in marks and _launches(item):
        marks.add("multirank")
    params = getattr(getattr(item, "callspec", None), "params", {})
    if any(m == module and params.get(p) == v for m, p, v in GPU_PARAMS):
        marks.add("gpu")
    return marks


def _check_table(items):
    """Warn about a MARKERS entry naming a test function its (collected) module does not define."""
    modules = {item.path.stem: item.module for item in items if getattr(item, "module", None) is not None}
    for key in MARKERS:
        module, _, name = key.partition("::")
        if name and module in modules and not hasattr(modules[module], name):
            warnings.warn(pytest.PytestWarning(f"tests/conftest.py MARKERS names {key}, which tests/{module}.py "
                                               "does not define"))


def pytest_collection_modifyitems(config, items):
    _check_table(items)
    for item in items:
        for mark in sorted(markers_of(item)):
            item.add_marker(getattr(pytest.mark, mark))


@pytest.fixture(scope="session")
def uncompressed_digits(tmp_path_factory):
    """examples/pytorch_digits.py uncompressed with the accuracy checks' ranks, epochs and seed
    (``digits_checks.ACCURACY_*``): the reference run of tests/test_demo.py's and
    tests/test_algorithms_convergence.py's checks (one launch for both). Its results as the example
    writes them; read, never changed."""
    return run_example(tmp_path_factory.mktemp("uncompressed_digits"), ACCURACY_NP, "examples/pytorch_digits.py",
                       "none", ["--compression", "none"] + ACCURACY_ARGS, timeout=240)
