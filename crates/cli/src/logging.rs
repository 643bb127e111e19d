//! `tracing` setup: `RUST_LOG` filters, human lines by default, JSON when configured.

use converger_gateway::LogFormat;
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; logs go to stderr so stdout stays machine-readable JSON.
pub fn init(format: LogFormat) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let installed = match format {
        LogFormat::Human => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
    if let Err(error) = installed {
        eprintln!("converger: logging not initialised: {error}");
    }
}
