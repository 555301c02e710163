"""pytest plugin for vLLM's own tests (``-p vllm_plugins_loaded``).

With ``MTPSTATE_LOAD_VLLM_PLUGINS=1`` it does what every vLLM process does at
start-up, before the tests run: ``load_general_plugins()``, which with
``VLLM_USE_MTPSTATE=1`` loads mtpstate's entry point. In every run it reports,
on one line that ``vllm_own_tests.py`` reads, which vLLM was imported,
whether its runner carries the patch (in its source, or applied by the
plugin) or shadow mode's wrappers, and how many runners took mtpstate's
state (a shadow's own runner counts) and how many shadows began."""

import json
import os
import sys

_built = []
_shadows = []


def pytest_configure(config):
    if os.environ.get("MTPSTATE_LOAD_VLLM_PLUGINS") == "1":
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    from mtpstate.integrations.vllm import adapter

    original = adapter.ModelRunnerV2State.__init__

    def counted(self, *args, **kwargs):
        _built.append(1)
        original(self, *args, **kwargs)

    adapter.ModelRunnerV2State.__init__ = counted
    from mtpstate.integrations.vllm.shadow import monitor

    shadow_init = monitor.Shadow.__init__

    def counted_shadow(self, *args, **kwargs):
        shadow_init(self, *args, **kwargs)
        _shadows.append(1)

    monitor.Shadow.__init__ = counted_shadow


def pytest_unconfigure(config):
    import vllm

    from mtpstate.integrations.vllm import plugin

    module = sys.modules.get(plugin.RUNNER_MODULE)
    v = plugin.check(module) if module is not None else None
    source = ""
    if module is not None:
        with open(module.__file__, encoding="utf-8") as f:
            source = f.read()
    report = {
        "vllm": os.path.dirname(vllm.__file__),
        "runner_module_imported": module is not None,
        "patch_in_source": plugin.ENV_VAR in source,
        "applied_by_plugin": bool(v and v.applied and v.ok),
        "states_built": len(_built),
        "shadow_set_up": module is not None
        and getattr(vars(module.GPUModelRunner)["update_requests"], "__mtpstate_shadow__", False),
        "shadows_built": len(_shadows),
    }
    print("MTPSTATE-REPORT " + json.dumps(report), flush=True)
