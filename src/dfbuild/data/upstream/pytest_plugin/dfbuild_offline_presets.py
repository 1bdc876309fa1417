"""A pytest plugin for running llama.cpp's server tests on a machine without network (`-p dfbuild_offline_presets`).

Upstream's tools/server/tests/conftest.py starts every session (or, in older trees, every module) with a
fixture that calls ServerPreset.load_all(), which starts every preset once with downloads allowed, to fill the
model cache before any test runs. Offline, llama-server falls back to its cache when a download fails, so a
machine that once ran the suite runs it offline; one whose cache never held the presets' Hugging Face models
fails that fixture, and with it every test. The DFlash test `dfbuild series export --upstream` writes uses none
of the presets, so this plugin makes ServerPreset.load_all a no-op and changes nothing else: no upstream file is
edited, and the test module, conftest's other fixtures and utils.ServerProcess run as upstream wrote them.
"""


def pytest_configure(config):
    import utils  # tools/server/tests/utils.py, on sys.path once conftest.py is loaded

    if not hasattr(utils.ServerPreset, "load_all"):
        raise RuntimeError("dfbuild_offline_presets: utils.ServerPreset has no load_all to skip in this tree")
    utils.ServerPreset.load_all = staticmethod(lambda: None)
