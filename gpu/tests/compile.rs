//! The CUDA kernels compile to PTX through NVRTC for the architectures seqpipe targets, on a
//! machine without a GPU (scripts/test.sh installs NVRTC and puts it on LD_LIBRARY_PATH). A
//! missing NVRTC fails the test: the kernels would otherwise only be compiled on a lent GPU.

use gpu::compile::{HEAD_DIMS, KERNELS, attention_kernels, compile_ptx, nvrtc_present};

fn require_nvrtc() {
    assert!(
        nvrtc_present(),
        "NVRTC (libnvrtc.so.13) is not loadable: run the suite through ./scripts/test.sh, which installs the nvidia-cuda-nvrtc wheel into .venv and puts its lib/ on LD_LIBRARY_PATH"
    );
}

#[test]
fn every_kernel_compiles_for_ampere_and_hopper_and_the_oldest_target() {
    require_nvrtc();
    // Turing (sm_75, the oldest GPU accepted) has no BF16 mma: its tensor-core attention kernels
    // compile to a trap, and the host never launches them there.
    for (arch, bf16_mma) in [("sm_75", false), ("sm_80", true), ("sm_90", true)] {
        let ptx = compile_ptx(arch).unwrap_or_else(|e| panic!("{e}"));
        let text = ptx.to_src();
        assert!(
            text.contains(&format!(".target {arch}")),
            "PTX for {arch} names another target"
        );
        let names: Vec<String> = KERNELS
            .iter()
            .map(|s| s.to_string())
            .chain(attention_kernels())
            .collect();
        assert_eq!(names.len(), KERNELS.len() + 6 * HEAD_DIMS.len());
        for name in names {
            assert!(
                text.contains(&format!(".entry {name}(")),
                "kernel {name} is missing from the PTX for {arch}"
            );
        }
        assert_eq!(
            text.contains("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"),
            bf16_mma,
            "BF16 mma in the PTX for {arch}"
        );
    }
}

#[test]
fn compile_errors_name_the_architecture_and_carry_the_log() {
    require_nvrtc();
    // An architecture NVRTC 13 does not know is refused with its log, not a panic.
    let err = gpu::compile::compile_ptx("sm_10").expect_err("sm_10 is not a real target");
    let msg = err.to_string();
    assert!(msg.contains("sm_10"), "{msg}");
}

#[test]
fn architecture_follows_the_compute_capability() {
    assert_eq!(gpu::compile::arch_for(8, 0), "sm_80");
    assert_eq!(gpu::compile::arch_for(9, 0), "sm_90");
    assert_eq!(gpu::compile::arch_for(8, 7), "sm_80");
    assert_eq!(gpu::compile::arch_for(12, 1), "sm_120");
}

#[test]
fn opening_a_gpu_without_a_driver_is_an_error_not_a_panic() {
    // CI machines have no NVIDIA driver: the open must fail with the driver named. (On a machine
    // with a GPU this test instead checks that the open succeeds.)
    // SAFETY: only probes for the library.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    match gpu::Gpu::open(0, gpu::Precision::Fp32) {
        Ok(g) => assert!(driver, "opened {} without a driver library", g.name()),
        Err(e) => {
            let msg = e.to_string();
            assert!(
                !driver || msg.contains("device") || msg.contains("library"),
                "{msg}"
            );
            if !driver {
                assert!(msg.contains("driver library could not be loaded"), "{msg}");
            }
        }
    }
}
