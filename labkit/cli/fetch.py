"""`labkit fetch MODEL|food11|dolly [--dest DIR]` and `labkit fetch --status --profile P` (core: labkit.zoo.fetch).

Run it on the node before a lab (or on the shared file system once), so no lab waits on a download
while the lease clock runs; runs then read the caches, offline with HF_HUB_OFFLINE=1.
"""
from __future__ import annotations

import click


@click.command("fetch", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("targets", nargs=-1)
@click.option("--dest", default=None, help="food11: destination folder [LABKIT_FOOD11 or ~/Food-11]")
@click.option("--status", "show_status", is_flag=True, help="list what PROFILE's labs use and what is cached")
@click.option("--profile", default="a100x4", show_default=True, help="profile for --status")
def command(targets: tuple[str, ...], dest: str | None, show_status: bool, profile: str) -> None:
    """Pre-download TARGETS: a Hugging Face model id (ORG/NAME), tinyllama-1.1b, llama2-7b, food11, dolly."""
    from labkit.zoo import fetch
    from labkit.errors import ConfigError

    if show_status:
        from labkit.profiles import get_profile
        click.echo(fetch.table(get_profile(profile)))
        return
    if not targets:
        raise ConfigError("name what to fetch, e.g. `labkit fetch TinyLlama/TinyLlama-1.1B-Chat-v1.0 food11 dolly`, "
                          "or list what a profile needs with `labkit fetch --status --profile a100x4`")
    for target in targets:
        where, what = fetch.fetch(target, dest=dest)
        click.echo(f"{target}: {what} -> {where}")
