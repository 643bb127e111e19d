//! Configuration loading: built-in defaults, then the TOML file, then `CONVERGER_*` variables.

use std::path::Path;

use converger_gateway::Config;
use figment::Figment;
use figment::providers::{Env, Format, Serialized, Toml};

/// The file read when `--config` is not given, relative to the working directory.
pub const DEFAULT_CONFIG_FILE: &str = "config/default.toml";

/// Variables with the `CONVERGER_` prefix that are not configuration keys.
const NOT_CONFIG_KEYS: &[&str] = &["config", "test_database_url", "bin"];

/// Loads and validates the configuration; the error names the offending key.
pub fn load(explicit_file: Option<&Path>) -> Result<Config, String> {
    let mut figment = Figment::from(Serialized::defaults(Config::default()));
    match explicit_file {
        Some(file) if !file.exists() => {
            return Err(format!("config file {} does not exist", file.display()));
        }
        Some(file) => figment = figment.merge(Toml::file_exact(file)),
        None if Path::new(DEFAULT_CONFIG_FILE).exists() => {
            figment = figment.merge(Toml::file_exact(DEFAULT_CONFIG_FILE))
        }
        None => {}
    }
    figment = figment.merge(
        Env::prefixed("CONVERGER_")
            .split("__")
            .ignore(NOT_CONFIG_KEYS),
    );
    let config: Config = figment.extract().map_err(describe)?;
    config.validate()?;
    Ok(config)
}

/// One line per problem, each naming its key and where the value came from.
fn describe(error: figment::Error) -> String {
    error
        .into_iter()
        .map(|problem| {
            let key = if problem.path.is_empty() {
                "(top level)".to_owned()
            } else {
                problem.path.join(".")
            };
            let source = problem
                .metadata
                .as_ref()
                .map(|metadata| format!(" (from {})", metadata.name))
                .unwrap_or_default();
            format!("key `{key}`: {}{source}", problem.kind)
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn repo_file(relative: &str) -> std::path::PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join(relative)
    }

    #[test]
    fn default_toml_documents_exactly_the_built_in_defaults() {
        let from_file: Config = Figment::from(Toml::file_exact(repo_file(DEFAULT_CONFIG_FILE)))
            .extract()
            .expect("config/default.toml parses");
        assert_eq!(from_file, Config::default());
    }

    #[test]
    fn default_toml_sets_every_key() {
        let text = std::fs::read_to_string(repo_file(DEFAULT_CONFIG_FILE)).unwrap();
        let table: toml::Table = text.parse().unwrap();
        let defaults = serde_json::to_value(Config::default()).unwrap();
        for (key, value) in defaults.as_object().unwrap() {
            assert!(table.contains_key(key), "config/default.toml lacks `{key}`");
            if let Some(section) = value.as_object() {
                let file_section = table[key].as_table().unwrap();
                for inner in section.keys() {
                    assert!(
                        file_section.contains_key(inner),
                        "config/default.toml lacks `{key}.{inner}`"
                    );
                }
            }
        }
    }

    #[test]
    fn test_toml_loads() {
        let from_file: Config = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::file_exact(repo_file("config/test.toml")))
            .extract()
            .expect("config/test.toml parses");
        from_file.validate().unwrap();
    }

    #[test]
    fn wrong_type_names_the_key() {
        let error = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string("[limits]\nmax_in_flight = \"many\""))
            .extract::<Config>()
            .unwrap_err();
        let message = describe(error);
        assert!(message.contains("limits.max_in_flight"), "{message}");
    }

    #[test]
    fn unknown_key_is_refused_by_name() {
        let error = Figment::from(Serialized::defaults(Config::default()))
            .merge(Toml::string("htp_addr = \"127.0.0.1:1\""))
            .extract::<Config>()
            .unwrap_err();
        assert!(describe(error).contains("htp_addr"));
    }
}
