#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The runtime on its own (no broker, no lanes), with the real faulty guest:
//! the WASI sandbox denies by default and grants what is configured, the
//! `config` import answers from the handler's table, `Runtime::load` refuses
//! what is not a handler component and says why, a faulted instance is thrown
//! away (reuse mode) or never kept (fresh mode), each fault has its kind, and
//! `handle-batch` answers in order or faults as a whole.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use weir::runtime::bindings::weir::handler::types::Failure;
use weir::runtime::{
    BatchOutcome, CallOutcome, Executor, FaultKind, HandlerSettings, HandlerVersion, InstanceMode, Interrupt, Runtime,
    RuntimeOptions,
};

use common::{faulty_bytes, message};

fn runtime(pool_instances: u32) -> Arc<Runtime> {
    Runtime::new(common::cached(RuntimeOptions {
        max_memory: 64 << 20,
        pool_instances,
        ..RuntimeOptions::default()
    }))
    .expect("runtime starts")
}

fn load(rt: &Runtime, settings: HandlerSettings) -> Arc<HandlerVersion> {
    rt.load(&faulty_bytes(), settings, "faulty test guest")
        .expect("the faulty guest loads")
}

/// Call `message_type` with `payload` and return the guest's answer (panics on a fault).
fn answer(exec: &mut Executor, v: &Arc<HandlerVersion>, message_type: &str, payload: &str) -> Result<(), Failure> {
    match exec.call(v, &message(message_type, Some("g"), payload.as_bytes()), &None) {
        CallOutcome::Done { result, .. } => result,
        CallOutcome::Fault(f) => panic!("`{message_type}` faulted: {f}"),
    }
}

fn rejection(exec: &mut Executor, v: &Arc<HandlerVersion>, message_type: &str, payload: &str) -> String {
    match answer(exec, v, message_type, payload) {
        Err(Failure::Reject(text)) => text,
        other => panic!("`{message_type}` should reject, answered {other:?}"),
    }
}

fn fault(outcome: CallOutcome) -> weir::runtime::Fault {
    match outcome {
        CallOutcome::Fault(f) => f,
        CallOutcome::Done { result, .. } => panic!("expected a fault, the guest answered {result:?}"),
    }
}

#[test]
fn wasi_is_denied_by_default() {
    let rt = runtime(8);
    let v = load(&rt, HandlerSettings::new("sandboxed"));
    let text = rejection(&mut Executor::new(rt), &v, "env", "");
    assert!(text.contains("HOME=None"), "no environment variable leaks in: {text}");
    assert!(text.contains("read_dir(/)=denied"), "no directory is visible: {text}");
}

#[test]
fn wasi_env_grant_is_visible() {
    let rt = runtime(8);
    let mut settings = HandlerSettings::new("granted");
    settings.wasi.env = vec![("HOME".into(), "/x".into())];
    let v = load(&rt, settings);
    let text = rejection(&mut Executor::new(rt), &v, "env", "");
    assert!(
        text.contains(r#"HOME=Some("/x")"#),
        "the granted variable is visible: {text}"
    );
    assert!(
        text.contains("read_dir(/)=denied"),
        "an env grant opens no directory: {text}"
    );
}

#[test]
fn config_import_answers_from_the_handlers_table() {
    let rt = runtime(8);
    let mut settings = HandlerSettings::new("configured");
    settings.config.insert("currency".into(), "EUR".into());
    let v = load(&rt, settings);
    let mut exec = Executor::new(rt);
    assert_eq!(rejection(&mut exec, &v, "config", "currency"), r#"config=Some("EUR")"#);
    assert_eq!(rejection(&mut exec, &v, "config", "missing"), "config=None");
}

#[test]
fn load_refuses_garbage_and_names_the_origin() {
    let rt = runtime(8);
    let err = rt
        .load(
            b"certainly not wasm",
            HandlerSettings::new("garbage"),
            "uploads/garbage.wasm",
        )
        .unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("uploads/garbage.wasm"),
        "the error names the origin: {text}"
    );
    assert!(
        text.contains("is not a valid WebAssembly component"),
        "the error says what is wrong: {text}"
    );
}

/// Issue 36 item 9: a text file or random bytes given as a handler get
/// "not WebAssembly at all", not the WAT text parser's error the engine
/// itself gives them (the control).
#[test]
fn load_says_text_and_random_bytes_are_not_webassembly() {
    let rt = runtime(8);
    let text = b"name = \"greeter\"\n";
    let raw = wasmtime::component::Component::new(rt.engine(), text)
        .err()
        .map(|e| format!("{e:#}"));
    assert!(
        raw.as_deref().is_some_and(|e| e.contains("expected")),
        "control: the engine answers with a text parser's error: {raw:?}"
    );
    for (bytes, looks) in [
        (text.to_vec(), "it looks like text"),
        (vec![0x9f, 0x92, 0x96, 0xff, 0x00], "its first bytes are not"),
        (Vec::new(), "it is empty"),
    ] {
        let err = format!(
            "{:#}",
            rt.load(&bytes, HandlerSettings::new("x"), "x.wasm").unwrap_err()
        );
        assert!(
            err.contains("x.wasm is not a valid WebAssembly component: it is not WebAssembly at all")
                && err.contains(looks),
            "{err}"
        );
        assert!(!err.contains("expected"), "no parser's error: {err}");
    }
}

#[test]
fn load_refuses_a_core_module() {
    let rt = runtime(8);
    // The smallest valid core module: magic and version, no sections.
    let module = b"\0asm\x01\0\0\0";
    assert!(
        wasmtime::Module::new(rt.engine(), module).is_ok(),
        "control: the bytes are a valid core module"
    );
    let err = rt.load(module, HandlerSettings::new("core"), "core.wasm").unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("core.wasm is not a valid WebAssembly component"),
        "{text}"
    );
}

#[test]
fn load_refuses_a_component_outside_the_world() {
    let rt = runtime(8);
    // A valid component that exports nothing: the binary preamble alone.
    let empty = b"\0asm\x0d\x00\x01\x00";
    assert!(
        wasmtime::component::Component::new(rt.engine(), empty).is_ok(),
        "control: a valid component"
    );
    let err = rt.load(empty, HandlerSettings::new("empty"), "empty.wasm").unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("empty.wasm does not implement the weir:handler/handler world"),
        "{text}"
    );
    assert!(text.contains("handle"), "the cause names the missing export: {text}");
}

#[test]
fn load_refuses_a_memory_limit_above_the_nodes() {
    let rt = runtime(8);
    let mut settings = HandlerSettings::new("greedy");
    settings.memory_limit = 128 << 20;
    let err = rt.load(&faulty_bytes(), settings, "greedy.wasm").unwrap_err();
    let text = format!("{err:#}");
    assert!(
        text.contains("greedy") && text.contains("limits.memory"),
        "the error names handler and key: {text}"
    );
}

/// Whether an instance was kept or dropped is observable in the pooling
/// allocator's count of live instances.
#[test]
fn reuse_mode_discards_a_trapped_instance() {
    let rt = runtime(8);
    let live = rt.engine().pooling_allocator_metrics().unwrap();
    let v = load(&rt, HandlerSettings::new("reused"));
    let mut a = Executor::new(rt.clone());

    assert!(answer(&mut a, &v, "ok", "").is_ok());
    assert_eq!(
        live.component_instances(),
        1,
        "control: the instance is kept after a call"
    );
    let f = fault(a.call(&v, &message("trap", None, b""), &None));
    assert_eq!(f.kind, FaultKind::Trap, "{f}");
    assert_eq!(live.component_instances(), 0, "the trapped instance was discarded");
    assert!(answer(&mut a, &v, "ok", "").is_ok(), "the next call after a trap works");
    assert!(answer(&mut a, &v, "ok", "").is_ok());
    assert_eq!(live.component_instances(), 1, "and its instance is kept again");
}

#[test]
fn fresh_mode_never_keeps_an_instance() {
    let rt = runtime(8);
    let live = rt.engine().pooling_allocator_metrics().unwrap();
    let mut settings = HandlerSettings::new("fresh");
    settings.instance_mode = InstanceMode::Fresh;
    let v = load(&rt, settings);
    let (mut a, mut b) = (Executor::new(rt.clone()), Executor::new(rt));
    assert!(answer(&mut a, &v, "ok", "").is_ok());
    assert_eq!(live.component_instances(), 0, "nothing kept after a call");
    assert!(answer(&mut b, &v, "ok", "").is_ok());
    assert_eq!(
        fault(a.call(&v, &message("trap", None, b""), &None)).kind,
        FaultKind::Trap
    );
    assert!(answer(&mut b, &v, "ok", "").is_ok());
    assert!(answer(&mut a, &v, "ok", "").is_ok(), "the next call after a trap works");
    assert_eq!(live.component_instances(), 0);
}

/// A fresh instance never sees what an earlier one left in the same pool
/// slot: the pool resets a returned memory by `memset` of the pages it
/// touched (`linear_memory_keep_resident`, PAGEMAP_SCAN) rather than
/// unmapping it, and this is the check that the reset is complete, below and
/// above the part kept resident. The control is reuse mode, where the same
/// instance's leftovers are found, so the scan can see them.
#[test]
fn a_fresh_instance_never_sees_an_earlier_ones_memory() {
    let rt = runtime(1);
    let marker = format!("weir-leak-{}", uuid::Uuid::new_v4().simple());
    let mut reuse = HandlerSettings::new("kept");
    reuse.instance_mode = InstanceMode::Reuse;
    let kept = load(&rt, reuse);
    let mut exec = Executor::new(rt.clone());
    assert!(answer(&mut exec, &kept, "leak-write", &marker).is_ok());
    let seen = rejection(&mut exec, &kept, "leak-scan", &marker);
    assert!(
        seen.starts_with("found at"),
        "control: the scan finds what the same instance left: {seen}"
    );
    drop(exec);

    let mut settings = HandlerSettings::new("fresh");
    settings.instance_mode = InstanceMode::Fresh;
    let v = load(&rt, settings);
    let mut exec = Executor::new(rt);
    for round in 0..3 {
        let marker = format!("{marker}-{round}");
        assert!(answer(&mut exec, &v, "leak-write", &marker).is_ok());
        let seen = rejection(&mut exec, &v, "leak-scan", &marker);
        assert!(
            seen.starts_with("clean"),
            "round {round}: a fresh instance (one pool slot, so the same one) saw the last one's memory: {seen}"
        );
    }
}

#[test]
fn each_fault_has_its_kind() {
    let rt = runtime(8);
    let mut settings = HandlerSettings::new("limited");
    settings.memory_limit = 16 << 20;
    settings.timeout = Duration::from_millis(200);
    let v = load(&rt, settings);
    let mut exec = Executor::new(rt);

    let started = Instant::now();
    let f = fault(exec.call(&v, &message("loop", None, b""), &None));
    let took = started.elapsed();
    assert_eq!(f.kind, FaultKind::Timeout, "{f}");
    // Never before the timeout; after it only by the epoch tick and the
    // scheduler, which a loaded machine stretches (an endless loop would
    // never return at all).
    assert!(
        took >= Duration::from_millis(200) && took < Duration::from_secs(5),
        "interrupted after {took:?}"
    );

    let f = fault(exec.call(&v, &message("hog", None, b""), &None));
    assert_eq!(f.kind, FaultKind::MemoryLimit, "{f}");
    assert!(
        f.detail.contains(&(16u64 << 20).to_string()),
        "the detail names the limit: {f}"
    );

    let f = fault(exec.call(&v, &message("recurse", None, b""), &None));
    assert_eq!(f.kind, FaultKind::Trap, "{f}");

    let cancel = Arc::new(Interrupt::default());
    let setter = {
        let cancel = cancel.clone();
        std::thread::spawn(move || {
            // Once the call is inside guest code (a cancel before it would refuse it).
            while cancel.running() == 0 {
                std::thread::yield_now();
            }
            cancel.cancel();
        })
    };
    let f = fault(exec.call(&v, &message("loop", None, b""), &Some(cancel)));
    setter.join().expect("the cancelling thread ran");
    assert_eq!(f.kind, FaultKind::Cancelled, "{f}");

    assert!(
        answer(&mut exec, &v, "ok", "").is_ok(),
        "the executor carries on after every fault"
    );
}

#[test]
fn batch_answers_each_member_in_order() {
    let rt = runtime(8);
    let v = load(&rt, HandlerSettings::new("batcher"));
    let mut exec = Executor::new(rt);
    let batch = vec![
        message("ok", Some("g"), b""),
        message("reject", Some("g"), b""),
        message("retry", Some("g"), b""),
        message("publish", Some("g"), b"fan-out"),
        message("ok", Some("g"), b""),
    ];
    let BatchOutcome::Done {
        results,
        published,
        unattributed,
    } = exec.call_batch(&v, &batch, &None)
    else {
        panic!("a batch without a trap member must not fault");
    };
    assert_eq!(results.len(), batch.len(), "one result per message");
    assert!(results[0].is_ok());
    assert!(
        matches!(&results[1], Err(Failure::Reject(r)) if r == "rejected by test"),
        "{:?}",
        results[1]
    );
    assert!(
        matches!(&results[2], Err(Failure::Retry(r)) if r == "retry by test"),
        "{:?}",
        results[2]
    );
    assert!(results[3].is_ok());
    assert!(results[4].is_ok());
    assert!(unattributed.is_empty(), "the SDK's loop names each member");
    let counts: Vec<usize> = published.iter().map(Vec::len).collect();
    assert_eq!(counts, [0, 0, 0, 1, 0], "the publish is returned as its member's");
    assert_eq!(published[3][0].envelope.payload, b"fan-out");
}

#[test]
fn batch_with_a_trapping_member_faults_as_a_whole() {
    let rt = runtime(8);
    let v = load(&rt, HandlerSettings::new("batcher"));
    let mut exec = Executor::new(rt);
    let batch = vec![
        message("ok", Some("g"), b""),
        message("trap", Some("g"), b""),
        message("ok", Some("g"), b""),
    ];
    match exec.call_batch(&v, &batch, &None) {
        BatchOutcome::Fault(f) => assert_eq!(f.kind, FaultKind::Trap, "{f}"),
        BatchOutcome::Done { results, .. } => panic!("a trapping batch answered {results:?}"),
    }
    let again = [message("ok", Some("g"), b"")];
    assert!(
        matches!(exec.call_batch(&v, &again, &None), BatchOutcome::Done { results, .. } if results.len() == 1 && results[0].is_ok()),
        "the next batch after a trap works"
    );
}

/// After a swap (the old version retired), a worker's next call frees the
/// instance it kept of the old version: a large guest's memory does not
/// linger until the instance cache fills. Counted with the pool's live
/// instances; the control is the same sequence without the retirement.
#[test]
fn a_retired_versions_instances_are_freed_at_the_next_call() {
    let rt = runtime(8);
    let metrics = rt.engine().pooling_allocator_metrics().unwrap();
    for retire in [true, false] {
        let old = load(&rt, HandlerSettings::new("swap-old"));
        let new = load(&rt, HandlerSettings::new("swap-new"));
        let mut exec = Executor::new(rt.clone());
        answer(&mut exec, &old, "ok", "").unwrap();
        assert_eq!(metrics.component_instances(), 1);
        if retire {
            old.retire();
        }
        answer(&mut exec, &new, "ok", "").unwrap();
        let want = if retire { 1 } else { 2 };
        assert_eq!(
            metrics.component_instances(),
            want,
            "retired: {retire}: live instances after the new version's first call"
        );
        drop(exec);
    }
}
