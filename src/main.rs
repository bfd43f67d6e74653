//! The `seqpipe` binary: the command line ([`cli`]), the benchmarks it runs ([`bench`]) and the
//! CUDA commands ([`cuda`]), over the `trainer` library.

mod bench;
mod cli;
mod cuda;

fn main() -> std::process::ExitCode {
    cli::main()
}
