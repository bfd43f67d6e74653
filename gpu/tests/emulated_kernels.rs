//! Every CUDA kernel, run on the CPU: `gpu/emu/kernels_emulated.cpp` includes `kernels.cu` under a
//! CUDA shim (`gpu/emu/cuda_shim.h`: a block's threads are OS threads, `__syncthreads` a barrier,
//! warp shuffles and tensor-core `mma` emulated) and compares each output with a double-precision reference. So the
//! kernels' indexing, tails, barriers and numerics are tested on every machine the suite runs on,
//! not only in a GPU session. Needs a C++20 compiler (`c++`, or `$CXX`; scripts/test.sh installs
//! g++).

use std::path::Path;
use std::process::Command;

/// Compiles `gpu/emu/<file>` with the C++ compiler and runs it; returns its output.
fn compile_and_run(file: &str, exe_name: &str) -> std::process::Output {
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let source = Path::new(env!("CARGO_MANIFEST_DIR")).join("emu").join(file);
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join(exe_name);
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
    Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", exe.display()))
}

#[test]
fn every_kernel_matches_its_double_precision_reference_when_emulated_on_the_cpu() {
    let run = compile_and_run("kernels_emulated.cpp", "kernels-emulated");
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
    // shapes in FP32, six on tensor cores (BF16 operands) and eight with the v2 tensor-core
    // kernels (the six and two more), each of FP32 and v2 also at four document-masked layouts,
    // the norms, cross-entropy, column sums, GELU, embeddings, RoPE, AdamW, sums of squares.
    let checked = stdout.lines().filter(|l| l.starts_with("ok")).count();
    let tensor_cores = |version: &str| {
        stdout
            .lines()
            .filter(|l| l.starts_with("ok") && l.contains(version))
            .count()
    };
    assert_eq!(tensor_cores("tensor cores "), 6 * 8 + 12 * 8, "{stdout}");
    assert_eq!(tensor_cores("tensor cores v2"), 12 * 8, "{stdout}");
    // Document masks: four layouts in FP32 and four with the v2 kernels.
    assert_eq!(tensor_cores("documents"), 2 * 4 * 8, "{stdout}");
    assert!(
        checked >= 288,
        "only {checked} outputs were checked:\n{stdout}"
    );
    assert!(stdout.contains("0 failures"), "{stdout}");
}

#[test]
fn the_emulated_tensor_core_mma_tells_the_isa_fragment_layout_from_wrong_ones() {
    // gpu/emu/mma_layout_probe.cpp: one warp loads A (16×16) and B (16×8) fragments as a kernel
    // would, with the PTX ISA's layout and with five plausible mistakes, and multiplies them
    // through cuda_shim.h's mma (built from the ISA's tables); small integer inputs make every
    // product exact, so the ISA layout must equal a CPU matmul and each mistake must not.
    let run = compile_and_run("mma_layout_probe.cpp", "mma-layout-probe");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "the emulated mma does not discriminate:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let line = |prefix: &str| stdout.lines().filter(|l| l.starts_with(prefix)).count();
    assert_eq!(line("match "), 1, "{stdout}");
    assert_eq!(line("caught"), 5, "{stdout}");
    assert!(
        stdout.contains("ISA layout") && stdout.contains(" 0 of 128 elements differ"),
        "{stdout}"
    );
    assert!(stdout.contains("0 failures"), "{stdout}");
}
