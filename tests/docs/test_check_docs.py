"""Parsing tests for scripts/check-docs.py: python3 -m unittest discover -s tests/docs"""

import importlib.util
import os
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "check_docs", os.path.join(HERE, "..", "..", "scripts", "check-docs.py"))
cd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cd)


class FakeHelps:
    """apron with `up` (--data DIR, --pg ADDR) and `pricebook show`."""

    TREE = {
        (): ({"--log": True, "-h": False, "--help": False}, {"up", "pricebook"}),
        ("up",): ({"--log": True, "--data": True, "--pg": True, "-h": False}, set()),
        ("pricebook",): ({"--log": True}, {"show"}),
        ("pricebook", "show"): ({"--log": True}, set()),
    }

    def get(self, binary, sub):
        return self.TREE[tuple(sub)]


class Slugs(unittest.TestCase):
    def test_github_slugs(self):
        self.assertEqual(cd.slug("Set-up: two commands on a fresh machine"),
                         "set-up-two-commands-on-a-fresh-machine")
        self.assertEqual(cd.slug("`apron up` and the [UI](ui.md)"), "apron-up-and-the-ui")
        self.assertEqual(cd.slug("max_concurrent, *per* principal"), "max_concurrent-per-principal")

    def test_repeated_headings_and_setext(self):
        text = "# Tests\n\n## Tests\n\nIntro\n=====\n```\n# not a heading\n```\n"
        self.assertEqual(cd.anchors(text), {"tests", "tests-1", "intro"})


class Links(unittest.TestCase):
    def test_links_skip_code(self):
        line = "see [tls](tls.md#pg-tls), ![img](img/a.png \"t\") and `[x](nope.md)`"
        self.assertEqual([t for _, t in cd.links(line)], ["tls.md#pg-tls", "img/a.png"])
        self.assertEqual(cd.links("[ref]: ../docs/x.md"), [(0, "../docs/x.md")])

    def test_spans_and_links_wrap_inside_a_paragraph(self):
        text = "# T\n\nrun `apron\nup --pg 0` or [the\nguide](g.md)\n\n| `a` | `b\n"
        self.assertEqual(list(cd.paragraphs(text)), [(1, "# T"), (3, "run `apron\nup --pg 0` or [the\nguide](g.md)"), (7, "| `a` | `b")])
        self.assertIn((3, "apron up --pg 0"), list(cd.command_lines(text)))
        self.assertEqual([t for _, t in cd.links(list(cd.paragraphs(text))[1][1])], ["g.md"])

    def test_resolution(self):
        with tempfile.TemporaryDirectory() as d:
            root = os.path.realpath(d)
            os.mkdir(os.path.join(root, "docs"))
            with open(os.path.join(root, "docs", "a.md"), "w") as f:
                f.write("# Top\n[ok](b.md#b-part) [bad](b.md#nope) [gone](c.md) "
                        "[out](../../etc/passwd) [self](#top) [web](https://x.org/a.md)\n"
                        "`../shared/design.md` `docs/b.md` `docs/zz.md` `apron-data/x.json`\n"
                        "```\n[not](a/link.md)\n```\n")
            with open(os.path.join(root, "docs", "b.md"), "w") as f:
                f.write("## B part\n")
            c = cd.Checker(root)
            c.check_file(os.path.join(root, "docs", "a.md"))
            self.assertEqual(c.report(), [
                "docs/a.md:2: broken anchor: b.md#nope (no such heading)",
                "docs/a.md:2: broken link: c.md (no such file or directory)",
                "docs/a.md:2: link leaves the repository: ../../etc/passwd",
                "docs/a.md:3: path outside the repository (or missing): ../shared/design.md",
                "docs/a.md:3: no such path: docs/zz.md",
            ])


class Commands(unittest.TestCase):
    def inv(self, line):
        return cd.invocations(cd.tokens(line))

    def test_invocations(self):
        self.assertEqual(self.inv('cargo run --release -p apron -- up --data "x y" | head'),
                         [("apron", ["up", "--data", "QUOTED"])])
        self.assertEqual(self.inv("psql -U apron -c 'SELECT 1' && ./target/release/apron-agent --source sim"),
                         [("apron-agent", ["--source", "sim"])])
        self.assertEqual(self.inv("apron serve [--config apron.toml] # comment --nope"),
                         [("apron", ["serve", "--config", "apron.toml"])])

    def test_help_parsing(self):
        text = ("Usage: apron [OPTIONS] <COMMAND>\n\nCommands:\n  serve  The server\n  up     All\n"
                "  help   Print\n\nOptions:\n      --log <LOG>\n          Log filter\n"
                "      --recompute  Rebuild\n  -V, --version\n")
        flags, commands = cd.parse_help(text)
        self.assertEqual(commands, {"serve", "up", "help"})
        self.assertEqual(flags, {"--log": True, "--recompute": False, "-V": False, "--version": False})

    def test_flags_against_help(self):
        h = FakeHelps()
        self.assertEqual(cd.check_args(h, "apron", ["--log", "debug", "up", "--data=d", "--pg", "x"]), [])
        self.assertEqual(cd.check_args(h, "apron", ["up", "…", "--nope"]),
                         ["`apron up` has no flag --nope (not in `apron up --help`)"])
        self.assertEqual(cd.check_args(h, "apron", ["pricebook", "show", "f.toml", "--config", "c"]),
                         ["`apron pricebook show` has no flag --config (not in `apron pricebook show --help`)"])
        # prose that names the binary is not a command line; a misspelt subcommand is
        self.assertEqual(cd.check_args(h, "apron", ["was", "built"]), [])
        self.assertEqual(cd.check_args(h, "apron", ["upp", "--data", "d"]),
                         ["`apron` has no subcommand upp (not in `apron --help`)"])
        self.assertEqual(cd.check_args(h, "apron", ["--bogus", "x", "up", "--nope"]),
                         ["`apron` has no flag --bogus (not in `apron --help`)",
                          "`apron` has no flag --nope (not in `apron --help`)"])


if __name__ == "__main__":
    unittest.main()
