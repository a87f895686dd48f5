"""`pool completion bash|zsh`: a shell completion script generated from the parser itself."""

from __future__ import annotations

import argparse
import shlex

from cli.output import EXIT_OK, Subparsers


def _paths(parser: argparse.ArgumentParser, path: str,
           out: dict[str, list[str]]) -> dict[str, list[str]]:
    """Each command path ("pool lease run") and the words that may follow it there."""
    words: list[str] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                words.append(name)
                _paths(sub, f"{path} {name}", out)
        elif action.help != argparse.SUPPRESS:
            words += [s for s in action.option_strings if s.startswith("--")]
    out[path] = words
    return out


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    paths = _paths(parser, "pool", {})
    steps = "|".join(shlex.quote(p) for p in sorted(paths) if p != "pool")
    cases = "\n".join(f"    {shlex.quote(p)}) words={shlex.quote(' '.join(w))} ;;"
                      for p, w in sorted(paths.items()))
    head = "autoload -U +X bashcompinit && bashcompinit\n" if shell == "zsh" else ""
    return f"""{head}# pool completion for {shell}: eval "$(pool completion {shell})"
_pool_complete() {{
  local i path=pool words
  for ((i = 1; i < COMP_CWORD; i++)); do
    case "$path ${{COMP_WORDS[i]}}" in
      {steps}) path="$path ${{COMP_WORDS[i]}}" ;;
    esac
  done
  case "$path" in
{cases}
  esac
  COMPREPLY=($(compgen -W "$words" -- "${{COMP_WORDS[COMP_CWORD]}}"))
}}
complete -o default -F _pool_complete pool
"""


def cmd_completion(args: argparse.Namespace) -> int:
    print(script(args.root_parser, args.shell), end="")
    return EXIT_OK


def register(sub: Subparsers) -> None:
    """Add `completion`."""
    cp = sub.add_parser("completion", help="print a shell completion script (bash or zsh)",
                        description='Load it with: eval "$(pool completion bash)" (in ~/.bashrc)'
                        ' or eval "$(pool completion zsh)" (in ~/.zshrc).')
    cp.add_argument("shell", choices=["bash", "zsh"])
    cp.set_defaults(func=cmd_completion)
