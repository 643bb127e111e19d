//! The REST surface against its OpenAPI document (`docs/openapi.yaml`): schemathesis, a
//! property-based API fuzzer from PyPI (installed by `.ci/test-prerequisites`), sends generated
//! valid and invalid requests to a real node over real HTTP with real credentials, and checks
//! that no response is a server error and every response matches the document (status code,
//! content type, body schema).

mod support;

use std::process::Command;

use support::{TestNode, workspace_root};

/// Generated cases per operation and phase: enough to reach every documented refusal, small
/// enough for CI on two cores.
const MAX_EXAMPLES: &str = "20";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_response_matches_the_openapi_document_and_none_is_a_server_error() {
    let node = TestNode::start().await;
    let acme = node.tenant_with_channel("acme").await;
    let (_, token) = node.conversation(&acme, "alice").await;
    let dir = tempfile::tempdir().expect("temp dir");
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(
        &config,
        format!(
            "[auth.openapi.AdminToken]\nbearer = \"{admin}\"\n\n\
             [auth.openapi.ApiKey]\napi_key = \"{api_key}\"\n\n\
             [auth.openapi.ChannelSecret]\nbearer = \"{secret}\"\n\n\
             [auth.openapi.Token]\nbearer = \"{token}\"\n",
            admin = node.admin_token,
            api_key = acme.api_key,
            secret = acme.secret,
        ),
    )
    .expect("write schemathesis.toml");
    let report = dir.path().join("report.json");
    let base_url = node.server.base_url();
    let schema = workspace_root().join("docs/openapi.yaml");
    // The fuzzer is a blocking child process: run it off the runtime the node serves on.
    let output = tokio::task::spawn_blocking(move || {
        Command::new("schemathesis")
            .arg("--config-file")
            .arg(&config)
            .arg("run")
            .arg(&schema)
            .args(["--url", &base_url])
            .args([
                "--checks",
                "not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance",
            ])
            .args(["--phases", "examples,coverage,fuzzing"])
            .args(["--max-examples", MAX_EXAMPLES])
            .args(["--seed", "22"])
            // One worker: with two threads, hypothesis's ast.parse of lambda sources hits
            // CPython 3.11's non-thread-safe AST recursion check (gh-106905, "AST constructor
            // recursion depth mismatch"), a fuzzer crash that has nothing to do with the node.
            .args(["--workers", "1"])
            .args(["--request-timeout", "10"])
            .args(["--generation-allow-x00", "true"])
            .arg("--no-color")
            .arg("--report-json-path")
            .arg(&report)
            .output()
    })
    .await
    .expect("the fuzzer's task")
    .expect("schemathesis runs: install it with .ci/test-prerequisites");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary: Vec<&str> = stdout
        .lines()
        .skip_while(|line| !line.contains("SUMMARY"))
        .collect();
    println!("{}", summary.join("\n"));
    assert!(
        output.status.success(),
        "schemathesis found responses the document does not describe, or server errors:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
