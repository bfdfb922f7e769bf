"Fixtures shared by the system tests."
import pytest


@pytest.fixture(scope="session")
def small_data(tmp_path_factory):
    "A small prepared EurLex folder shared by the sweep and study tests (--data-dir), so no test tokenizes the whole sample."
    from altgrad.data import prepare_eurlex, shared_data_dir
    d = tmp_path_factory.mktemp("data") / "eurlex"
    prepare_eurlex(d, source=shared_data_dir() / "eurlex", max_docs=300, progress=False)
    return d


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA devices (skipped without them)")
