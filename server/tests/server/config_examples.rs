//! Every TOML example a user may copy loads with the real parser: the ```toml blocks of
//! docs/, README.md and every crate's and deploy/'s README, the annotated examples in
//! the config modules' docs (`//! ```toml`), and the shipped files under deploy/. An
//! example that does not load (a misspelt key, a key in the wrong section) fails here,
//! before a user copies it.

use std::path::{Path, PathBuf};

/// Which parser a block is for, by its first section.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Parser {
    Server,
    Agent,
    PriceBook,
    Teams,
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root").to_owned()
}

/// The agent's sections; a price book's `[[price]]`; a team map's `[[team]]`/`[teams]`.
fn parser_for(text: &str) -> Parser {
    let first = text
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_start_matches('[').split([']', '.']).next().unwrap_or_default().trim().to_owned())
        .unwrap_or_default();
    match first.as_str() {
        "agent" | "otlp" | "samplers" | "shipper" | "source" | "attribution" | "exposition" => Parser::Agent,
        "price" | "prices" | "book" => Parser::PriceBook,
        "team" | "teams" | "rules" => Parser::Teams,
        _ => Parser::Server,
    }
}

fn load(parser: Parser, text: &str, origin: &Path) -> Result<(), String> {
    match parser {
        Parser::Server => apron::FileConfig::parse(text, origin).map(drop).map_err(|e| e.to_string()),
        Parser::Agent => apron_agent::config::FileConfig::parse(text, origin).map(drop).map_err(|e| e.to_string()),
        Parser::PriceBook => apron_cost::pricebook::PriceBook::from_toml(text).map(drop).map_err(|e| e.to_string()),
        Parser::Teams => apron_cost::team::TeamConfig::from_toml(text).map(drop).map_err(|e| e.to_string()),
    }
}

/// The ```toml blocks of a Markdown file, with the line each starts on. Indented blocks
/// (inside a list item) are de-indented.
fn markdown_blocks(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut lines = text.lines().enumerate();
    while let Some((no, line)) = lines.next() {
        let trimmed = line.trim_start();
        if !trimmed.starts_with("```toml") {
            continue;
        }
        let indent = line.len() - trimmed.len();
        let mut block = String::new();
        for (_, l) in lines.by_ref() {
            if l.trim_start().starts_with("```") {
                break;
            }
            block.push_str(l.get(indent.min(l.len() - l.trim_start().len())..).unwrap_or(l));
            block.push('\n');
        }
        out.push((no + 1, block));
    }
    out
}

/// The ```toml block of a module's `//!` docs.
fn doc_blocks(text: &str) -> Vec<(usize, String)> {
    let docs: String = text
        .lines()
        .map(|l| l.strip_prefix("//! ").or_else(|| l.strip_prefix("//!")).unwrap_or(""))
        .fold(String::new(), |mut s, l| {
            s.push_str(l);
            s.push('\n');
            s
        });
    markdown_blocks(&docs)
}

fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    for dir in ["docs"] {
        let mut md: Vec<_> = std::fs::read_dir(root.join(dir))
            .expect("docs/")
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "md"))
            .collect();
        md.sort();
        files.extend(md);
    }
    for entry in std::fs::read_dir(root).expect("root").filter_map(Result::ok) {
        let readme = entry.path().join("README.md");
        if readme.is_file() {
            files.push(readme);
        }
    }
    files.push(root.join("deploy/kubernetes/README.md"));
    files.retain(|f| f.is_file());
    files
}

fn deploy_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("deploy/").filter_map(Result::ok) {
        let p = entry.path();
        if p.is_dir() {
            deploy_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "toml") {
            out.push(p);
        }
    }
}

#[test]
fn every_toml_example_loads_with_the_real_parser() {
    let root = root();
    let mut examples: Vec<(String, Parser, String)> = Vec::new();
    for file in markdown_files(&root) {
        let text = std::fs::read_to_string(&file).expect("read");
        for (line, block) in markdown_blocks(&text) {
            let name = format!("{}:{line}", file.strip_prefix(&root).unwrap_or(&file).display());
            examples.push((name, parser_for(&block), block));
        }
    }
    for (module, parser) in [
        ("server/src/config.rs", Parser::Server),
        ("agent/src/config.rs", Parser::Agent),
        ("cost/src/pricebook.rs", Parser::PriceBook),
        ("cost/src/team.rs", Parser::Teams),
    ] {
        let text = std::fs::read_to_string(root.join(module)).expect("read");
        for (line, block) in doc_blocks(&text) {
            examples.push((format!("{module} (//! line {line})"), parser, block));
        }
    }
    let mut shipped = Vec::new();
    deploy_files(&root.join("deploy"), &mut shipped);
    shipped.sort();
    for file in shipped {
        let text = std::fs::read_to_string(&file).expect("read");
        let name = file.strip_prefix(&root).unwrap_or(&file).display().to_string();
        let parser = match file.file_name().and_then(|n| n.to_str()).unwrap_or_default() {
            n if n.starts_with("agent") => Parser::Agent,
            n if n.starts_with("pricebook") => Parser::PriceBook,
            n if n.starts_with("teams") => Parser::Teams,
            _ => parser_for(&text),
        };
        examples.push((name, parser, text));
    }
    assert!(examples.len() >= 25, "found only {} examples: is the scan broken?", examples.len());
    let failures: Vec<String> = examples
        .iter()
        .filter_map(|(name, parser, text)| {
            load(*parser, text, Path::new(name)).err().map(|e| format!("{name} ({parser:?}): {e}"))
        })
        .collect();
    assert!(failures.is_empty(), "TOML examples that do not load:\n{}", failures.join("\n"));
    println!("{} TOML examples load", examples.len());
}
