//! The CUDA kernels compile to PTX and cubins through NVRTC for the architectures seqpipe targets,
//! on a machine without a GPU (scripts/test.sh installs NVRTC and puts it on LD_LIBRARY_PATH). A
//! missing NVRTC fails the test: the kernels would otherwise only be compiled on a lent GPU. The
//! kernel cache's checks and the choice between cubin, PTX and a compile run without NVRTC.

use gpu::compile::{
    CacheContents, CacheFiles, CachedCubin, Compiled, HEAD_DIMS, ImageChoice, KERNELS,
    attention_kernels, choose_image, compile, cubin_sm, inspect_cache, nvrtc_present, store,
};

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
        let compiled = compile(arch).unwrap_or_else(|e| panic!("{e}"));
        // The cubin is a CUDA ELF of exactly this architecture.
        assert_eq!(&compiled.cubin[..4], b"\x7fELF", "cubin for {arch}");
        let sm: u32 = arch[3..].parse().unwrap();
        assert_eq!(cubin_sm(&compiled.cubin), Ok(sm), "cubin for {arch}");
        let text = compiled.ptx;
        assert!(
            text.contains(&format!(".target {arch}")),
            "PTX for {arch} names another target"
        );
        let names: Vec<String> = KERNELS
            .iter()
            .map(|s| s.to_string())
            .chain(attention_kernels())
            .collect();
        assert_eq!(names.len(), KERNELS.len() + 9 * HEAD_DIMS.len());
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
        // The v2 attention reads its tiles with 16-byte loads and rounds two floats per
        // instruction (sm_75 has no BF16 mma: its tensor-core kernels are a trap).
        for d in HEAD_DIMS.iter().filter(|_| bf16_mma) {
            for pass in ["forward", "backward_dq", "backward_dkdv"] {
                let name = format!("attn_tc2_{pass}_d{d}");
                let body = entry_body(&text, &name);
                assert!(
                    body.contains("ld.global.v4.f32") || body.contains("ld.global.nc.v4.f32"),
                    "{name} has no 16-byte loads in the PTX for {arch}"
                );
                assert!(
                    body.contains("cvt.rn.bf16x2.f32"),
                    "{name} does not round pairs to bf16 with cvt.rn.bf16x2 in the PTX for {arch}"
                );
            }
        }
    }
}

/// The PTX of one kernel: from its `.entry` to the next one (or the end).
fn entry_body<'a>(ptx: &'a str, name: &str) -> &'a str {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} is missing from the PTX"));
    let rest = &ptx[start + 1..];
    let end = rest.find(".entry ").unwrap_or(rest.len());
    &rest[..end]
}

#[test]
fn compile_errors_name_the_architecture_and_carry_the_log() {
    require_nvrtc();
    // An architecture NVRTC 13 does not know is refused with its log, not a panic.
    let err = gpu::compile::compile("sm_10").expect_err("sm_10 is not a real target");
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

// The emulated GPU (`--features emulate`) opens with no driver at all, by design.
#[cfg(not(feature = "emulate"))]
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

/// A minimal CUDA ELF header as NVRTC 13 writes it (ELF ABI version 8: the SM version in the
/// second byte of `e_flags`), followed by `body`.
fn fake_cubin(sm: u32, body: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; 64];
    h[..4].copy_from_slice(b"\x7fELF");
    h[4] = 2; // 64-bit
    h[5] = 1; // little-endian
    h[7] = 0x41; // CUDA's OS ABI
    h[8] = 8; // ABI version
    h[18..20].copy_from_slice(&190u16.to_le_bytes()); // EM_CUDA
    h[48..52].copy_from_slice(&(0x0600_0004 | (sm << 8)).to_le_bytes());
    h.extend_from_slice(body);
    h
}

#[test]
fn cubin_headers_name_their_architecture_and_other_files_are_refused() {
    assert_eq!(cubin_sm(&fake_cubin(90, b"")), Ok(90));
    assert_eq!(cubin_sm(&fake_cubin(80, b"")), Ok(80));
    // Before ABI version 8 the SM version is the low byte.
    let mut old = fake_cubin(0, b"");
    old[8] = 7;
    old[48] = 75;
    assert_eq!(cubin_sm(&old), Ok(75));
    assert!(cubin_sm(b"// PTX text, not an ELF").is_err());
    let mut x86 = fake_cubin(90, b"");
    x86[18] = 62; // EM_X86_64
    assert!(cubin_sm(&x86).unwrap_err().contains("not CUDA"));
    assert!(cubin_sm(&fake_cubin(90, b"")[..40]).is_err());
}

#[test]
fn the_cache_trusts_a_cubin_only_with_its_hash_and_a_damaged_one_is_rebuilt() {
    let dir = std::env::temp_dir().join(format!("seqpipe-cubin-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let files = CacheFiles::in_dir(&dir, "sm_90");
    assert_eq!(
        inspect_cache(&files),
        CacheContents {
            cubin: CachedCubin::Absent,
            ptx: false
        }
    );
    let compiled = Compiled {
        ptx: ".version 9.0\n.target sm_90\n".into(),
        cubin: fake_cubin(90, b"machine code"),
    };
    store(&files, &compiled).unwrap();
    let intact = inspect_cache(&files);
    assert_eq!(intact.cubin, CachedCubin::Intact { sm: 90 });
    assert!(intact.ptx);
    assert_eq!(choose_image((9, 0), "sm_90", &intact), ImageChoice::Cubin);

    // One flipped byte: the hash no longer matches, the cubin is rebuilt rather than loaded.
    let mut bytes = std::fs::read(&files.cubin).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&files.cubin, &bytes).unwrap();
    let damaged = inspect_cache(&files);
    let CachedCubin::Damaged(why) = &damaged.cubin else {
        panic!("a corrupt cubin was accepted: {damaged:?}");
    };
    assert!(why.contains("does not match"), "{why}");
    assert!(matches!(
        choose_image((9, 0), "sm_90", &damaged),
        ImageChoice::Compile { why } if why.contains("damaged")
    ));

    // No sidecar (a cubin written by something else, or a write cut short): not trusted.
    store(&files, &compiled).unwrap();
    std::fs::remove_file(&files.cubin_hash).unwrap();
    assert!(
        matches!(inspect_cache(&files).cubin, CachedCubin::Damaged(w) if w.contains("sidecar"))
    );

    // A file that hashes right but is not a CUDA ELF (e.g. PTX saved under the cubin's name).
    let not_elf = Compiled {
        ptx: compiled.ptx.clone(),
        cubin: b"// PTX".to_vec(),
    };
    store(&files, &not_elf).unwrap();
    assert!(matches!(inspect_cache(&files).cubin, CachedCubin::Damaged(w) if w.contains("ELF")));

    // Storing again repairs it.
    store(&files, &compiled).unwrap();
    assert_eq!(inspect_cache(&files).cubin, CachedCubin::Intact { sm: 90 });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_device_loads_the_cubin_of_its_architecture_else_the_ptx_else_compiles() {
    let cubin = |sm| CachedCubin::Intact { sm };
    let cache = |cubin, ptx| CacheContents { cubin, ptx };
    let choose = |cap: (i32, i32), c: &CacheContents| {
        let arch = gpu::compile::arch_for(cap.0, cap.1);
        match choose_image(cap, arch, c) {
            ImageChoice::Cubin => "cubin",
            ImageChoice::Ptx { .. } => "ptx",
            ImageChoice::Compile { .. } => "compile",
        }
    };
    // (device capability, cache contents, choice)
    let table = [
        ((9, 0), cache(cubin(90), true), "cubin"),
        ((9, 0), cache(cubin(90), false), "cubin"),
        ((8, 0), cache(cubin(80), true), "cubin"),
        // An A10/A40 (8.6) wants sm_86: the sm_86 cubin, not another architecture's.
        ((8, 6), cache(cubin(86), false), "cubin"),
        // A cubin of another architecture is never loaded: the PTX is JIT-compiled instead,
        // or, without PTX, the kernels are compiled.
        ((9, 0), cache(cubin(80), true), "ptx"),
        ((8, 0), cache(cubin(90), true), "ptx"),
        ((8, 0), cache(cubin(90), false), "compile"),
        ((10, 0), cache(cubin(90), true), "ptx"),
        ((9, 0), cache(CachedCubin::Absent, true), "ptx"),
        ((9, 0), cache(CachedCubin::Absent, false), "compile"),
        // A damaged cubin is rebuilt, even when PTX is there.
        (
            (9, 0),
            cache(CachedCubin::Damaged("hash".into()), true),
            "compile",
        ),
    ];
    for (cap, contents, want) in table {
        assert_eq!(
            choose(cap, &contents),
            want,
            "device {cap:?}, cache {contents:?}"
        );
    }
    // The reasons say what was found.
    let ImageChoice::Ptx { why } = choose_image((9, 0), "sm_90", &cache(cubin(80), true)) else {
        unreachable!()
    };
    assert!(why.contains("sm_80") && why.contains("sm_90"), "{why}");
}
