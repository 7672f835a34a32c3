//! accrue: the command-line client (submit, status, list, cancel, resume,
//! watch, local). Parses flags, sets up tracing, calls the library.
use accrue::Cli;
use clap::FromArgMatches;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(|| accrue::out::QuietStderr)
        .init();
    let cli = match Cli::from_arg_matches(&accrue::command().get_matches()) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    match accrue::run(cli).await {
        Ok(code) => code,
        Err(e) => {
            // One line, each cause once (docs/OPERATIONS.md, "Errors").
            accrue::errln!("error: {}", accrue_proto::error_chain(e.as_ref()));
            std::process::ExitCode::from(2)
        }
    }
}
