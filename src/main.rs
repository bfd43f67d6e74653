fn main() -> std::process::ExitCode {
    trainer::cli::main()
}
