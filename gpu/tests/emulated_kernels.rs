//! Every CUDA kernel, run on the CPU: `gpu/emu/kernels_emulated.cpp` includes `kernels.cu` under a
//! CUDA shim (`gpu/emu/cuda_shim.h`: a block's threads are OS threads, `__syncthreads` a barrier,
//! warp shuffles and tensor-core `mma` emulated) and compares each output with a double-precision reference. So the
//! kernels' indexing, tails, barriers and numerics are tested on every machine the suite runs on,
//! not only in a GPU session. Needs a C++20 compiler (`c++`, or `$CXX`; scripts/test.sh installs
//! g++).

use std::path::Path;
use std::process::Command;

#[test]
fn every_kernel_matches_its_double_precision_reference_when_emulated_on_the_cpu() {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("emu/kernels_emulated.cpp");
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("kernels-emulated");
    let compiled = Command::new(&cxx)
        .args(["-std=c++20", "-O2", "-pthread", "-o"])
        .arg(&exe)
        .arg(&source)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run the C++ compiler `{cxx}` ({e}): install g++ (Debian: apt-get install g++; scripts/test.sh does as root) or set CXX"
            )
        });
    assert!(
        compiled.status.success(),
        "compiling {} with {cxx} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&compiled.stderr)
    );
    let run = Command::new(&exe)
        .output()
        .expect("running the emulated kernels");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "emulated kernels differ from their references:\n{}\n{}",
        stdout
            .lines()
            .filter(|l| !l.starts_with("ok"))
            .collect::<Vec<_>>()
            .join("\n"),
        String::from_utf8_lossy(&run.stderr)
    );
    // Every output was compared: attention (y, lse, dq, dk, dv in both dK/dV modes) at nine
    // shapes in FP32 and six on tensor cores (BF16 operands), the norms, cross-entropy, column
    // sums, GELU, embeddings, RoPE, AdamW, sums of squares.
    let checked = stdout.lines().filter(|l| l.starts_with("ok")).count();
    let tensor_cores = stdout
        .lines()
        .filter(|l| l.contains("tensor cores"))
        .count();
    assert_eq!(tensor_cores, 48, "{stdout}");
    assert!(
        checked >= 160,
        "only {checked} outputs were checked:\n{stdout}"
    );
    assert!(stdout.contains("0 failures"), "{stdout}");
}
