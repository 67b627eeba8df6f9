"""``statediff doctor --model M [engine options]``: the known engine bugs a configuration meets, no engine."""

from __future__ import annotations

from pathlib import Path

import click

from statediff.errors import StatediffError


@click.command("doctor", short_help="Known engine bugs a vLLM configuration meets (no engine started).",
               context_settings={"ignore_unknown_options": False})
@click.option("--model", "model", type=click.Path(path_type=Path), required=True, metavar="M",
              help="Local model directory (its config.json is read) or the config.json itself.")
@click.option("--speculative-config", metavar="JSON", help="As vllm serve takes it ('{\"method\": \"ngram\", ...}').")
@click.option("--enable-prefix-caching/--no-enable-prefix-caching", "prefix_caching", default=None,
              help="As vllm serve; unset: vLLM 0.32's default (on).")
@click.option("--quantization", "-q", metavar="METHOD", help="As vllm serve's --quantization.")
@click.option("--dtype", metavar="DTYPE", help="As vllm serve's --dtype.")
@click.option("--model-runner", type=click.Choice(["v1", "v2"]), help="vLLM's model runner (unset: v1 on cpu).")
@click.option("--vllm-version", metavar="X.Y.Z", help="Another deployment's vLLM (unset: the installed one).")
@click.option("--platform", metavar="NAME", help="cpu, cuda, rocm, ... (unset: from the installed vLLM wheel).")
@click.option("-v", "--verbose", is_flag=True, help="Also say how unstated facts were decided, and each bug's evidence.")
def doctor_cmd(model: Path, speculative_config: str | None, prefix_caching: bool | None, quantization: str | None,
               dtype: str | None, model_runner: str | None, vllm_version: str | None, platform: str | None,
               verbose: bool) -> int:
    """Print the known engine bugs (statediff/enginebugs/known_bugs.toml) that serving M with these
    options meets: one line each, the line the vLLM plugin logs as a WARNING when such an engine
    starts. Exit 0: none; 1: at least one; 2: error (and where no vLLM is installed and --vllm-version or
    --platform is not given: an unknown version matches no range, so no all-clear). Needs neither torch nor an engine.
    """
    from statediff.enginebugs import matches
    from statediff.enginebugs.doctor import facts_for

    facts, notes = facts_for(model, speculative_config=speculative_config, prefix_caching=prefix_caching,
                             quantization=quantization, dtype=dtype, model_runner=model_runner,
                             vllm_version=vllm_version, platform=platform)
    if not facts.vllm or not facts.platform:  # a version range cannot match an unknown version: no all-clear
        raise StatediffError("no vLLM is installed here to read its version and platform from: pass "
                             "--vllm-version X.Y.Z and --platform cpu|cuda|rocm for the deployment you ask about")
    found = matches(facts)
    if verbose:
        for note in notes:
            click.echo(f"  {note}")
    for bug in found:
        click.echo(bug.line())
        if verbose:
            click.echo(f"  evidence: {bug.measured}")
            if bug.workaround:
                click.echo(f"  workaround: {bug.workaround}")
    if not found:
        click.echo(f"statediff: no known engine bug matches (vLLM {facts.vllm or '?'} on {facts.platform or '?'}, "
                   f"drafter {facts.drafter}, {'hybrid' if facts.hybrid else 'non-hybrid'} target, prefix caching "
                   f"{'on' if facts.prefix_caching else 'off'}, {facts.target_format})")
    return 1 if found else 0
