//! With the `emulate` feature, compiles the CPU emulation of the CUDA kernels
//! (`emu/launcher.cpp`, which includes `src/kernels.cu`) into the crate. Without it, nothing.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "emulate")]
    {
        println!("cargo:rerun-if-changed=emu/launcher.cpp");
        println!("cargo:rerun-if-changed=emu/cuda_shim.h");
        println!("cargo:rerun-if-changed=src/kernels.cu");
        cc::Build::new()
            .cpp(true)
            .std("c++20")
            .file("emu/launcher.cpp")
            .flag("-pthread")
            .opt_level(2)
            .warnings(false)
            .compile("seqpipe_kernels_emu");
    }
}
