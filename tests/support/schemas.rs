//! The frame schemas of `docs/protocol/schemas/`, compiled once per test binary. Every frame a
//! test receives over a WebSocket is checked against the server schema of its scope, so the whole
//! integration suite doubles as a conformance test of what the server sends.

use std::sync::OnceLock;

use jsonschema::{Registry, Validator};
use serde_json::Value;

use super::workspace_root;

/// Which side of which scope a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schema {
    /// End user → server.
    ClientConversation,
    /// Server → end user.
    ServerConversation,
    /// Agent → server.
    ClientChannel,
    /// Server → agent.
    ServerChannel,
}

impl Schema {
    fn file(self) -> &'static str {
        match self {
            Schema::ClientConversation => "client-conversation.schema.json",
            Schema::ServerConversation => "server-conversation.schema.json",
            Schema::ClientChannel => "client-channel.schema.json",
            Schema::ServerChannel => "server-channel.schema.json",
        }
    }
}

struct Validators {
    client_conversation: Validator,
    server_conversation: Validator,
    client_channel: Validator,
    server_channel: Validator,
}

const FILES: [&str; 5] = [
    "common.schema.json",
    "client-conversation.schema.json",
    "server-conversation.schema.json",
    "client-channel.schema.json",
    "server-channel.schema.json",
];

fn load(file: &str) -> Value {
    let path = workspace_root().join("docs/protocol/schemas").join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|error| panic!("{}: {error}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

fn validators() -> &'static Validators {
    static VALIDATORS: OnceLock<Validators> = OnceLock::new();
    VALIDATORS.get_or_init(|| {
        let documents: Vec<(String, Value)> = FILES
            .iter()
            .map(|file| {
                let document = load(file);
                let id = document["$id"]
                    .as_str()
                    .expect("every schema has an $id")
                    .to_owned();
                (id, document)
            })
            .collect();
        let mut registry = Registry::new();
        for (id, document) in &documents {
            registry = registry
                .add(id.as_str(), document.clone())
                .expect("schema registers");
        }
        let registry = registry.prepare().expect("schemas resolve");
        let build = |schema: Schema| {
            let document = load(schema.file());
            jsonschema::options()
                .with_registry(&registry)
                .build(&document)
                .unwrap_or_else(|error| panic!("{} compiles: {error}", schema.file()))
        };
        Validators {
            client_conversation: build(Schema::ClientConversation),
            server_conversation: build(Schema::ServerConversation),
            client_channel: build(Schema::ClientChannel),
            server_channel: build(Schema::ServerChannel),
        }
    })
}

/// The schema's complaints about `frame`; empty when it conforms.
pub fn violations(schema: Schema, frame: &Value) -> Vec<String> {
    let validators = validators();
    let validator = match schema {
        Schema::ClientConversation => &validators.client_conversation,
        Schema::ServerConversation => &validators.server_conversation,
        Schema::ClientChannel => &validators.client_channel,
        Schema::ServerChannel => &validators.server_channel,
    };
    if validator.is_valid(frame) {
        return Vec::new();
    }
    validator
        .iter_errors(frame)
        .map(|error| format!("{} at {}", error, error.instance_path()))
        .collect()
}

/// Panics, naming the schema and the reasons, when `frame` does not conform.
pub fn assert_conforms(schema: Schema, frame: &Value) {
    let problems = violations(schema, frame);
    assert!(
        problems.is_empty(),
        "frame does not conform to {}: {frame}\n{}",
        schema.file(),
        problems.join("\n")
    );
}
