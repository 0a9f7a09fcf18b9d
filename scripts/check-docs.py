#!/usr/bin/env python3
"""Docs check (CI: scripts/test.sh). Standard library only.

1. Links: every relative link and `#anchor` in every tracked *.md resolves. Targets are
   files or directories inside the repository (a link may not leave it); anchors use
   GitHub's heading slugs. Paths named in inline code (`docs/ingest.md`) must exist too
   when their first directory does, and may not leave the repository either.
2. Flags: every `apron ...` / `apron-agent ...` flag named in a tracked *.md (README.md,
   docs/, every README; code blocks and inline code; `cargo run -p apron -- ...` counts)
   exists in that command's (or subcommand's) `--help` output.

Usage: scripts/check-docs.py [--apron PATH] [--apron-agent PATH] [--links-only]
Binaries default to $CARGO_TARGET_DIR/debug or target/debug. Failures print as
`file:line: what`; the exit status is 1 when there are any.
"""

import argparse
import os
import re
import subprocess
import sys
import unicodedata
from urllib.parse import unquote

# Protocol spellings that look like paths under the `http/` crate directory.
PROTOCOL_NAMES = {"http/protobuf", "http/json", "http/1.1", "http/2"}

ROOT = os.path.realpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
BINARIES = ("apron", "apron-agent")

# --- Markdown scanning ---------------------------------------------------------------

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target "title") and ![alt](target); text may hold one level of [...] nesting.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+[\"'(].*?[\"')])?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:[ \t]*(<[^>]*>|\S+)", re.M)
HTML_ATTR = re.compile(r"""<(?:a|img|source)\b[^>]*?\b(?:href|src)\s*=\s*["']([^"']+)["']""", re.I)
HTML_ID = re.compile(r"""<[a-z][^>]*?\b(?:id|name)\s*=\s*["']([^"']+)["']""", re.I)
ATX = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)\s*$")


def scan(text):
    """Yield (line_no, kind, content): kind 'text' (prose, code spans still in it) or
    'code' (a line of a fenced or indented code block)."""
    fence = None
    for no, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):].strip():
                fence = None
            else:
                yield no, "code", line
            continue
        yield no, "text", line


def paragraphs(text):
    """(first line number, text) of each prose paragraph, its lines joined with "\n"
    (a code span or a link may wrap); headings and table rows stand alone."""
    block, start = [], 0
    for no, kind, line in scan(text):
        alone = kind == "text" and (ATX.match(line) or line.lstrip().startswith("|"))
        if kind != "text" or not line.strip() or alone:
            if block:
                yield start, "\n".join(block)
                block = []
            if alone:
                yield no, line
            continue
        if not block:
            start = no
        block.append(line)
    if block:
        yield start, "\n".join(block)


def strip_code_spans(text):
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def links(text):
    """(offset, target) of the links in prose (code spans excluded)."""
    prose = strip_code_spans(text)
    out = [(m.start(), m.group(1)) for m in INLINE_LINK.finditer(prose)]
    out += [(m.start(), m.group(1)) for m in REF_DEF.finditer(prose)]
    out += [(m.start(), m.group(1)) for m in HTML_ATTR.finditer(prose)]
    return [(at, t[1:-1] if t.startswith("<") and t.endswith(">") else t) for at, t in sorted(out)]


def slug(heading):
    """GitHub's anchor for a heading's text: markup dropped, lower case, punctuation
    other than '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links → their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "")
    text = re.sub(r"(\*+|(?<!\w)_+|_+(?!\w))", "", text)  # emphasis markers
    out = []
    for ch in text.strip().lower():
        cat = unicodedata.category(ch)
        if ch in "-_" or cat[0] in "LN" or cat == "Mn":
            out.append(ch)
        elif ch == " ":
            out.append("-")
    return "".join(out)


def anchors(text):
    """Every anchor a Markdown file defines (headings, with -1, -2 for repeats, and
    HTML id/name attributes)."""
    seen = {}
    found = set()
    prev = None
    for _, kind, line in scan(text):
        if kind != "text":
            prev = None
            continue
        heading = None
        m = ATX.match(line)
        if m:
            heading = m.group(2)
        elif prev is not None and prev.strip() and SETEXT.match(line) and not ATX.match(prev):
            heading = prev.strip()
        if heading is not None:
            base = slug(heading)
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
        found.update(HTML_ID.findall(strip_code_spans(line)))
        prev = line
    return found


# Paths named in inline code: relative, with a '/', no placeholders or globs.
CODE_PATH = re.compile(r"^(?:\.\.?/)*[A-Za-z0-9_.@-]+(?:/[A-Za-z0-9_.@-]+)*/?$")


def code_spans(text):
    """(offset, content) of the inline code spans of prose, line breaks as spaces."""
    return [(m.start(), m.group(2).replace("\n", " ")) for m in CODE_SPAN.finditer(text)]


def code_paths(text):
    """(offset, path) of repository-looking paths named in inline code spans."""
    out = []
    for at, span in code_spans(text):
        span = re.sub(r"#[\w-]+$", "", span.strip())
        if "/" in span and CODE_PATH.match(span) and "://" not in span:
            out.append((at, span))
    return out


def is_external(target):
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target)) or target.startswith("//")


class Checker:
    def __init__(self, root=ROOT):
        self.root = root
        self.failures = []
        self._anchors = {}
        self._ignored = {}

    def fail(self, path, line, what):
        self.failures.append((os.path.relpath(path, self.root), line, what))

    def report(self):
        """The failures as `file:line: what`, in file and line order."""
        return [f"{f}:{n}: {what}" for f, n, what in sorted(self.failures, key=lambda x: x[:2])]

    def inside(self, path):
        real = os.path.realpath(path)
        return real == self.root or real.startswith(self.root + os.sep)

    def anchors_of(self, path):
        if path not in self._anchors:
            with open(path, encoding="utf-8") as f:
                self._anchors[path] = anchors(f.read())
        return self._anchors[path]

    def check_link(self, md, line, target):
        if is_external(target):
            return
        target, _, anchor = target.partition("#")
        target = unquote(target)
        if target.startswith("/"):
            dest = os.path.join(self.root, target.lstrip("/"))
        elif target:
            dest = os.path.join(os.path.dirname(md), target)
        else:
            dest = md
        if not self.inside(dest):
            self.fail(md, line, f"link leaves the repository: {target}")
            return
        if not os.path.exists(dest):
            self.fail(md, line, f"broken link: {target} (no such file or directory)")
            return
        if anchor and dest.endswith(".md") and os.path.isfile(dest):
            if unquote(anchor).lower() not in self.anchors_of(dest):
                where = f"{target}#{anchor}" if target else f"#{anchor}"
                self.fail(md, line, f"broken anchor: {where} (no such heading)")

    def ignored(self, path):
        """Whether git ignores `path` (a build output), outside a git checkout never."""
        if path not in self._ignored:
            r = subprocess.run(["git", "-C", self.root, "check-ignore", "-q", path], capture_output=True)
            self._ignored[path] = r.returncode == 0
        return self._ignored[path]

    def check_code_path(self, md, line, path):
        """A path in inline code may be relative to the file or to the repository root."""
        if path in PROTOCOL_NAMES:
            return
        starts = (os.path.dirname(md), self.root)
        if path.startswith("../"):
            if not any(self.inside(os.path.join(s, path)) and os.path.exists(os.path.join(s, path)) for s in starts):
                self.fail(md, line, f"path outside the repository (or missing): {path}")
            return
        rel = path[2:] if path.startswith("./") else path
        first = rel.split("/")[0]
        # Only a path whose first directory exists in the repository is a claim about it
        # (`apron-data/endpoints.json` is a runtime path), and not one under a directory
        # git ignores (`target/ship/bin`: build outputs, present or not by when the
        # check runs).
        claims = [
            s for s in starts if os.path.isdir(os.path.join(s, first)) and not self.ignored(os.path.join(s, first))
        ]
        if claims and not any(os.path.exists(os.path.join(s, rel)) for s in claims):
            self.fail(md, line, f"no such path: {path}")

    def check_file(self, md):
        with open(md, encoding="utf-8") as f:
            text = f.read()
        for start, para in paragraphs(text):
            for at, target in links(para):
                self.check_link(md, start + para.count("\n", 0, at), target)
            for at, path in code_paths(para):
                self.check_code_path(md, start + para.count("\n", 0, at), path)


def markdown_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "-z", "--", "*.md"],
                             capture_output=True, check=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d, dirs, names in os.walk(root):
            dirs[:] = [x for x in dirs if x not in (".git", "target", "node_modules")]
            files += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".md")]
    return sorted(os.path.join(root, f) for f in files if os.path.isfile(os.path.join(root, f)))


# --- Command lines -------------------------------------------------------------------

SHELL_STOP = {"|", "||", "&&", ";", "&", ")", "(", "{", "}", ">", ">>", "<", "2>", "2>&1", "&>", "#"}
ELLIPSIS = {"…", "...", "[…]", "[...]"}


def tokens(command):
    """Shell-ish words: quoted strings become one opaque word, '[--x]' brackets go."""
    command = re.sub(r'"(?:\\.|[^"\\])*"|\'[^\']*\'|\$\([^)]*\)', " QUOTED ", command)
    out = []
    for word in command.split():
        if word.startswith("#"):
            break
        word = word.strip("[]")
        if word:
            out.append(word)
    return out


def invocations(words):
    """(binary, args) for each apron / apron-agent command in a list of words."""
    found = []
    i = 0
    while i < len(words):
        w = words[i]
        prev = words[i - 1] if i else ""
        binary = None
        if w == "cargo" and i + 1 < len(words) and words[i + 1] == "run":
            j = i + 2
            pkg = None
            while j < len(words) and words[j] != "--" and words[j] not in SHELL_STOP:
                if words[j] in ("-p", "--package", "--bin") and j + 1 < len(words):
                    pkg = words[j + 1]
                    j += 1
                elif words[j].startswith(("--package=", "--bin=")):
                    pkg = words[j].split("=", 1)[1]
                j += 1
            if pkg in BINARIES:
                if j < len(words) and words[j] == "--":
                    found.append((pkg, command_args(words[j + 1:])))
                    i = j + 1
                else:
                    found.append((pkg, []))
                    i = j
                continue
        elif w in BINARIES and not prev.startswith("-"):
            binary = w
        elif "/" in w and os.path.basename(w) in BINARIES and re.match(r"^(\./|.*\b(bin|target/[\w-]+)/)", w):
            binary = os.path.basename(w)
        if binary:
            args = command_args(words[i + 1:])
            found.append((binary, args))
            i += 1 + len(args)
            continue
        i += 1
    return found


def command_args(words):
    out = []
    for w in words:
        if w in SHELL_STOP or w.endswith(";") or w.startswith(("|", ">", "&", "(", "`")):
            break
        out.append(w)
    return out


# clap indents option lines by 2 (`  -h, --help`) or 6 (`      --log <LOG>`); the
# descriptions of `--help`'s long form by 10.
HELP_OPTION = re.compile(r"^ {2,6}(?:(-[A-Za-z0-9]),\s+)?(--[A-Za-z0-9][\w-]*)(?:[ =]<[^>]+>)?|^ {2,6}(-[A-Za-z0-9])(?:\s|$)")
HELP_COMMAND = re.compile(r"^  ([a-z][\w-]*)(?:\s{2,}|$)")


def parse_help(text):
    """(flags → takes a value, subcommands) from clap's --help output."""
    flags, commands = {}, set()
    section = None
    for line in text.splitlines():
        if line and not line[0].isspace():
            section = line.rstrip(":").strip().lower() if line.endswith(":") else None
            continue
        if section and "option" in section:
            m = HELP_OPTION.match(line)
            if m:
                short, long, lone = m.group(1), m.group(2), m.group(3)
                takes = bool(re.match(r"^ {2,6}(?:-\w,\s+)?--[\w-]+[ =]<", line))
                for f in (short, long, lone):
                    if f:
                        flags[f] = takes
        elif section == "commands":
            m = HELP_COMMAND.match(line)
            if m:
                commands.add(m.group(1))
    return flags, commands


class Helps:
    """`--help` of each (binary, subcommand…) path, run once."""

    def __init__(self, paths):
        self.paths = paths
        self.cache = {}

    def get(self, binary, sub):
        key = (binary,) + tuple(sub)
        if key not in self.cache:
            run = subprocess.run([self.paths[binary], *sub, "--help"], capture_output=True,
                                 text=True, timeout=60)
            if run.returncode != 0:
                raise RuntimeError(f"{self.paths[binary]} {' '.join(sub)} --help: exit {run.returncode}: {run.stderr.strip()}")
            self.cache[key] = parse_help(run.stdout)
        return self.cache[key]


def check_args(helps, binary, args):
    """Problems with one invocation's flags, as strings."""
    problems = []
    sub = []
    flags, commands = helps.get(binary, sub)
    positional = False
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            break
        if a in ELLIPSIS:  # `apron report … --close`: elided arguments
            i += 1
            continue
        if a.startswith("-") and len(a) > 1 and not re.match(r"^-\d", a):
            name = a.split("=", 1)[0]
            if name.startswith("--") or len(name) == 2:
                if name not in flags:
                    where = " ".join([binary, *sub])
                    problems.append(f"`{where}` has no flag {name} (not in `{where} --help`)")
                elif flags[name] and "=" not in a:
                    i += 1  # its value
            i += 1
            continue
        if not positional and a in commands and a != "help":
            sub.append(a)
            flags, commands = helps.get(binary, sub)
        elif not sub and commands and i == 0:
            # "apron-agent was built …" is prose that names the binary, not a command;
            # a word followed by flags is a subcommand that does not exist.
            if any(x.startswith("--") for x in args[i + 1:]):
                return [f"`{binary}` has no subcommand {a} (not in `{binary} --help`)"]
            return []
        else:
            positional = True
        i += 1
    return problems


def command_lines(text):
    """(line_no, command text) for code-block lines (continuations joined) and the
    inline code spans of prose."""
    pending, start = "", 0
    for no, kind, line in scan(text):
        if kind != "code":
            continue
        if not pending:
            start = no
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""
    if pending:
        yield start, pending
    for start, para in paragraphs(text):
        for at, span in code_spans(para):
            yield start + para.count("\n", 0, at), span


def check_flags(checker, helps, files):
    for md in files:
        with open(md, encoding="utf-8") as f:
            text = f.read()
        for no, command in command_lines(text):
            for binary, args in invocations(tokens(command)):
                for problem in check_args(helps, binary, args):
                    checker.fail(md, no, problem)


def find_binary(name, given):
    if given:
        return given
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    return os.path.join(target, "debug", name)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--apron", help="the apron binary (default: target/debug/apron)")
    ap.add_argument("--apron-agent", help="the apron-agent binary (default: target/debug/apron-agent)")
    ap.add_argument("--links-only", action="store_true", help="skip the --help flag check")
    opts = ap.parse_args(argv)

    checker = Checker()
    files = markdown_files(ROOT)
    for md in files:
        checker.check_file(md)
    if not opts.links_only:
        paths = {"apron": find_binary("apron", opts.apron),
                 "apron-agent": find_binary("apron-agent", opts.apron_agent)}
        for name, path in paths.items():
            if not os.access(path, os.X_OK):
                print(f"check-docs: {name} binary not found at {path} (build it, or pass --{name} PATH)", file=sys.stderr)
                return 2
        try:
            check_flags(checker, Helps(paths), files)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            print(f"check-docs: {e}", file=sys.stderr)
            return 2
    for failure in checker.report():
        print(failure)
    print(f"check-docs: {len(files)} Markdown files, {len(checker.failures)} problem(s)", file=sys.stderr)
    return 1 if checker.failures else 0


if __name__ == "__main__":
    sys.exit(main())
