//! The engine's modules form a graph without loops.
//!
//! Nodes are the top-level modules of `engine/src` (`backend`, `comm`, `model`, …); an
//! edge `a → b` is a path in `a`'s source — test code included — that names `crate::b`
//! (or a name the crate root re-exports from `b`, or `super::b` in a file directly under
//! `src`). Comments do not count. A loop means two modules cannot be understood, tested or
//! replaced one without the other; the test names every edge of the first loop it finds,
//! with the file that makes it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Source text without `//` comments (doc comments included) and string literals.
fn code_only(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    let (mut in_string, mut in_block) = (false, 0usize);
    while let Some(c) = chars.next() {
        match c {
            _ if in_block > 0 => {
                if c == '*' && chars.peek() == Some(&'/') {
                    chars.next();
                    in_block -= 1;
                } else if c == '/' && chars.peek() == Some(&'*') {
                    chars.next();
                    in_block += 1;
                }
            }
            _ if in_string => match c {
                '\\' => {
                    chars.next();
                }
                '"' => in_string = false,
                _ => {}
            },
            '"' => in_string = true,
            '/' if chars.peek() == Some(&'/') => {
                for c in chars.by_ref() {
                    if c == '\n' {
                        out.push('\n');
                        break;
                    }
                }
            }
            '/' if chars.peek() == Some(&'*') => {
                chars.next();
                in_block = 1;
            }
            // A char literal of a quote would open a string: skip `'"'`.
            '\'' if chars.peek() == Some(&'"') => {
                chars.next();
                chars.next();
            }
            _ => out.push(c),
        }
    }
    out
}

fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first names of every path after `prefix` (`crate::`): `crate::a::x` gives `a`,
/// `crate::{a::x, b}` gives `a` and `b`.
fn names_after(code: &str, prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (at, _) in code.match_indices(prefix) {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &code[at + prefix.len()..];
        if let Some(list) = rest.strip_prefix('{') {
            let (mut depth, mut start) = (0, 0);
            for (i, c) in list.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => {
                        out.push(ident(list[start..i].trim()).to_string());
                        break;
                    }
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        out.push(ident(list[start..i].trim()).to_string());
                        start = i + 1;
                    }
                    _ => {}
                }
            }
        } else {
            out.push(ident(rest).to_string());
        }
    }
    out
}

/// `module → (module it names → a file that names it)`, from `files` (path under `src`,
/// text).
fn edges(files: &BTreeMap<PathBuf, String>) -> BTreeMap<String, BTreeMap<String, PathBuf>> {
    let top = |p: &Path| {
        p.components().next().map(|c| c.as_os_str().to_string_lossy().trim_end_matches(".rs").to_string())
    };
    let modules: BTreeSet<String> = files.keys().filter_map(|p| top(p)).filter(|m| m != "lib").collect();
    // Names the crate root re-exports: `pub use engine::{Engine, …};` maps each to `engine`.
    let mut reexports = BTreeMap::new();
    if let Some(lib) = files.get(Path::new("lib.rs")) {
        for line in code_only(lib).lines().filter_map(|l| l.trim().strip_prefix("pub use ")) {
            let module = ident(line).to_string();
            if !modules.contains(&module) {
                continue;
            }
            let rest = &line[module.len()..].trim_start_matches("::");
            let names = rest.trim_start_matches('{').trim_end_matches(';').trim_end_matches('}');
            for name in names.split(',').map(|n| n.trim().rsplit("::").next().unwrap_or("").to_string()) {
                reexports.insert(name, module.clone());
            }
        }
    }
    let mut out: BTreeMap<String, BTreeMap<String, PathBuf>> = BTreeMap::new();
    for (path, text) in files {
        let Some(from) = top(path).filter(|m| m != "lib") else { continue };
        let code = code_only(text);
        let mut named = names_after(&code, "crate::");
        // `super::` leaves the module only from a file directly under `src`.
        if path.components().count() == 1 || path.ends_with("mod.rs") && path.components().count() == 2 {
            named.extend(names_after(&code, "super::").into_iter().filter(|n| modules.contains(n)));
        }
        for name in named {
            let to = if modules.contains(&name) { Some(name) } else { reexports.get(&name).cloned() };
            if let Some(to) = to.filter(|t| *t != from) {
                out.entry(from.clone()).or_default().entry(to).or_insert_with(|| path.clone());
            }
        }
    }
    out
}

/// A loop of the graph, as its modules in order (the first repeated at the end).
fn find_loop(graph: &BTreeMap<String, BTreeMap<String, PathBuf>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeMap<String, PathBuf>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|n| n == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_string());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flat_map(|e| e.keys()) {
            if let Some(c) = visit(next, graph, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(node.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut Vec::new(), &mut done))
}

fn sources(dir: &Path, under: &Path, out: &mut BTreeMap<PathBuf, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, under, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let rel = path.strip_prefix(under).unwrap().to_path_buf();
            out.insert(rel, std::fs::read_to_string(&path).unwrap());
        }
    }
}

#[test]
fn the_engines_modules_form_no_loop() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = BTreeMap::new();
    sources(&src, &src, &mut files);
    let graph = edges(&files);
    for (from, to) in &graph {
        eprintln!("{from} → {}", to.keys().cloned().collect::<Vec<_>>().join(", "));
    }
    assert!(graph.len() >= 10, "too few modules found: {graph:?}");
    if let Some(cycle) = find_loop(&graph) {
        let why: Vec<String> = cycle
            .windows(2)
            .map(|w| format!("{} → {} ({})", w[0], w[1], graph[&w[0]][&w[1]].display()))
            .collect();
        panic!("the engine's modules form a loop: {}", why.join(", "));
    }
}

#[test]
fn a_loop_is_found_and_comments_are_not_edges() {
    let files: BTreeMap<PathBuf, String> = [
        ("lib.rs", "pub mod a; pub mod b; pub mod c;\npub use c::Thing;"),
        ("a.rs", "use crate::{b::X, c};\n// crate::nothing here\nfn f() { let s = \"crate::b\"; }"),
        ("b/mod.rs", "pub mod inner;"),
        ("b/inner.rs", "use crate::Thing;"),
        ("c.rs", "/// [`crate::a`]\nfn g() {}"),
    ]
    .into_iter()
    .map(|(p, t)| (PathBuf::from(p), t.to_string()))
    .collect();
    let graph = edges(&files);
    assert_eq!(graph["a"].keys().collect::<Vec<_>>(), ["b", "c"]);
    assert_eq!(graph["b"].keys().collect::<Vec<_>>(), ["c"], "a re-exported name is its module's");
    assert!(!graph.contains_key("c"), "a doc link is no edge");
    assert_eq!(find_loop(&graph), None);
    let mut looped = files.clone();
    looped.insert(PathBuf::from("c.rs"), "use crate::a::f;".to_string());
    assert_eq!(find_loop(&edges(&looped)), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
}
