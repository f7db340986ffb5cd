//! The C API from Rust through `extern "C"` (README, "From C, C++ or Rust"): the loop an outside engine
//! writes, fed a reference dump's tokens. This "engine" gives zeros for its embedding rows, so
//! `diffrun compare OUT REF` must name `embd` at step 0 as the first wrong tensor.
//!
//!   test_capi_rust REF.h5 OUT.h5 N_EMBD
use std::ffi::{c_void, CStr, CString};
use std::os::raw::{c_char, c_int};
use std::process::exit;
use std::ptr;

#[repr(C)]
struct DiffrunDump {
    _private: [u8; 0],
}

const DIFFRUN_F32: i32 = 0;
const DIFFRUN_I32: i32 = 4;
const DIFFRUN_DUMP_OK: c_int = 0;
const DIFFRUN_DUMP_E_CHECKPOINT: c_int = 5;

#[link(name = "diffrun-dump-writer")]
extern "C" {
    fn diffrun_dump_open(path: *const c_char, out: *mut *mut DiffrunDump) -> c_int;
    fn diffrun_dump_copy_meta(d: *mut DiffrunDump, reference_path: *const c_char) -> c_int;
    fn diffrun_dump_set_string(d: *mut DiffrunDump, name: *const c_char, value: *const c_char) -> c_int;
    fn diffrun_dump_step_tokens(d: *mut DiffrunDump, step: c_int, ids: *mut *const i32, n: *mut usize) -> c_int;
    fn diffrun_dump_step(d: *mut DiffrunDump, step: c_int) -> c_int;
    fn diffrun_dump_put(d: *mut DiffrunDump, name: *const c_char, layer: c_int, dims: *const i64, ndim: c_int,
                        dtype: i32, data: *const c_void) -> c_int;
    fn diffrun_dump_close(d: *mut DiffrunDump) -> c_int;
    fn diffrun_dump_last_error(d: *const DiffrunDump) -> *const c_char;
}

fn cstr(s: &str) -> CString {
    CString::new(s).expect("no NUL in a name")
}

fn last_error(d: *const DiffrunDump) -> String {
    unsafe { CStr::from_ptr(diffrun_dump_last_error(d)).to_string_lossy().into_owned() }
}

// Ends the program with the library's message when a call failed.
fn check(d: *const DiffrunDump, rc: c_int, what: &str) {
    if rc != DIFFRUN_DUMP_OK {
        eprintln!("test_capi_rust: {}: code {}: {}", what, rc, last_error(d));
        exit(1);
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 4 {
        eprintln!("usage: {} REF.h5 OUT.h5 N_EMBD", args[0]);
        exit(2);
    }
    let reference = cstr(&args[1]);
    let out = cstr(&args[2]);
    let n_embd: usize = args[3].parse().unwrap_or_else(|_| {
        eprintln!("test_capi_rust: N_EMBD '{}' is not a count", args[3]);
        exit(2)
    });
    let mut d: *mut DiffrunDump = ptr::null_mut();
    let mut steps = 0;
    unsafe {
        check(ptr::null(), diffrun_dump_open(out.as_ptr(), &mut d), "open");
        check(d, diffrun_dump_copy_meta(d, reference.as_ptr()), "copy_meta");
        check(d, diffrun_dump_set_string(d, cstr("backend").as_ptr(), cstr("rust-test").as_ptr()), "backend");
        check(d, diffrun_dump_set_string(d, cstr("precision").as_ptr(), cstr("f32").as_ptr()), "precision");
        loop {
            let mut ids: *const i32 = ptr::null();
            let mut n: usize = 0;
            if diffrun_dump_step_tokens(d, steps, &mut ids, &mut n) != DIFFRUN_DUMP_OK {
                break; // past the reference's last step
            }
            check(d, diffrun_dump_step(d, steps), "step");
            let t = [n as i64];
            check(d, diffrun_dump_put(d, cstr("tokens").as_ptr(), -1, t.as_ptr(), 1, DIFFRUN_I32, ids as *const c_void),
                  "tokens");
            // The engine's forward pass would go here; its embedding rows are zeros: the bug to find.
            let embd = vec![0.0f32; n * n_embd];
            let dims = [n as i64, n_embd as i64];
            check(d, diffrun_dump_put(d, cstr("embd").as_ptr(), -1, dims.as_ptr(), 2, DIFFRUN_F32,
                                      embd.as_ptr() as *const c_void), "embd");
            // A name outside the checkpoint vocabulary is refused at the call, with the reason.
            let rc = diffrun_dump_put(d, cstr("ffn_down-0").as_ptr(), 0, dims.as_ptr(), 2, DIFFRUN_F32,
                                      embd.as_ptr() as *const c_void);
            let msg = last_error(d);
            if rc != DIFFRUN_DUMP_E_CHECKPOINT || !msg.contains("not a checkpoint name") {
                eprintln!("test_capi_rust: ffn_down-0 gave code {} and \"{}\"", rc, msg);
                exit(1);
            }
            steps += 1;
        }
        check(ptr::null(), diffrun_dump_close(d), "close");
    }
    println!("test_capi_rust: wrote {} steps", steps);
}
