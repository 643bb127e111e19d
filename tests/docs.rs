//! The operator guide documents every configuration key of `config/default.toml` (the file that
//! is itself checked against the built-in defaults by the cli crate's tests).

mod support;

#[test]
fn the_operations_guide_documents_every_configuration_key() {
    let root = support::workspace_root();
    let defaults: toml::Table = std::fs::read_to_string(root.join("config/default.toml"))
        .unwrap()
        .parse()
        .unwrap();
    let guide = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let mut missing = Vec::new();
    for (key, value) in &defaults {
        match value.as_table() {
            Some(section) => {
                for inner in section.keys() {
                    if !guide.contains(&format!("{key}.{inner}"))
                        && !guide.contains(&format!("`{inner}`"))
                    {
                        missing.push(format!("{key}.{inner}"));
                    }
                }
            }
            None => {
                if !guide.contains(&format!("`{key}`")) {
                    missing.push(key.clone());
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "docs/operations.md does not document: {missing:?}"
    );
}
