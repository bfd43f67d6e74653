//! The `seqpipe` binary: the command line ([`cli`]), the benchmarks it runs ([`bench`]) and the
//! CUDA commands ([`cuda`]), over the `trainer` library; [`malloc`] sets how freed memory is kept.

mod bench;
mod cli;
mod cuda;
mod cuda_link;
mod malloc;

#[global_allocator]
static ALLOCATOR: malloc::Allocator = malloc::Allocator::new();

fn main() -> std::process::ExitCode {
    malloc::keep_freed_memory(&ALLOCATOR);
    cli::main()
}
