"""One vLLM release as mtpstate supports it (:class:`Release`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources


@dataclass(frozen=True)
class Release:
    """A supported vLLM release.

    Parameters
    ----------
    version
        The release (``"0.34.0"``).
    runner
        ``GPUModelRunner.method`` -> fingerprint: the methods its patch changes.
    computed
        module -> function -> fingerprint: vLLM functions whose results
        mtpstate computes in their place.
    sampler
        module -> ``Class.method`` (or function) -> fingerprint: the sampler
        methods mtpstate answers, writes for, or keeps the bodies of, and the
        UVA pools it uploads into.
    differences
        What differs from the next supported release, and what mtpstate
        does about it.
    """

    version: str
    runner: dict[str, str]
    computed: dict[str, dict[str, str]]
    sampler: dict[str, dict[str, str]]
    differences: str = ""
    package: str = field(default="", compare=False)

    def patch_text(self) -> str:
        """The release's patch (``mrv2.patch`` of its folder): the upstream-PR
        form of what the plugin applies in memory."""
        return resources.files(self.package).joinpath("mrv2.patch").read_text()

    @property
    def patch_path(self) -> str:
        """The patch's path in the installed package."""
        return str(resources.files(self.package).joinpath("mrv2.patch"))
