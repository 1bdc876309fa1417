"""A pytest plugin for running llama.cpp's server tests on a machine without network (`-p dfbuild_offline_presets`).

Upstream's tools/server/tests/conftest.py has a session fixture, load_server_presets, that starts every
ServerPreset once with downloads allowed, to fill the model cache before any test runs. Offline, llama-server
falls back to its cache when a download fails, so a machine that once ran the suite runs it offline; one whose
cache never held the presets' Hugging Face models (this one: no network at all) fails that fixture, and with it
every test of the session. The new DFlash test uses none of the presets, so this plugin skips the preload and
nothing else: the test module, conftest's other fixtures and utils.ServerProcess run as upstream wrote them.
"""


def pytest_configure(config):
    import utils  # tools/server/tests/utils.py, on sys.path once conftest.py is loaded

    utils.ServerPreset.load_all = staticmethod(lambda: None)
