// build.rs: link libdiffrun-dump-writer as pkg-config says, its rpath included (PKG_CONFIG_PATH=P/lib/pkgconfig).
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let out = Command::new("pkg-config").args(["--libs", "diffrun-dump-writer"]).output().expect("pkg-config");
    assert!(out.status.success(), "pkg-config --libs diffrun-dump-writer failed: is PKG_CONFIG_PATH P/lib/pkgconfig?");
    for flag in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        if let Some(dir) = flag.strip_prefix("-L") {
            println!("cargo:rustc-link-search=native={dir}");
        } else if let Some(lib) = flag.strip_prefix("-l") {
            println!("cargo:rustc-link-lib=dylib={lib}");
        } else if flag.starts_with("-Wl,") {
            println!("cargo:rustc-link-arg={flag}");
        }
    }
}
