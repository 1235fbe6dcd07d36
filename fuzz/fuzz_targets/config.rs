//! The configuration layers: any TOML file (with the defaults under it) gives settings that
//! validate, or errors naming the options; never a panic, and a loaded configuration always
//! passes its own validation.
#![no_main]

use std::collections::BTreeMap;
use std::io::Write;

use kvevent_sidecar::Settings;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path =
        std::env::temp_dir().join(format!("kvevent-fuzz-config-{}.toml", std::process::id()));
    let Ok(mut f) = std::fs::File::create(&path) else {
        return;
    };
    if f.write_all(data).is_err() {
        return;
    }
    drop(f);
    let loaded = Settings::load(Some(&path), BTreeMap::<String, String>::new());
    let _ = std::fs::remove_file(&path);
    match loaded {
        Ok(settings) => {
            settings.validate().expect("loaded settings validate");
        }
        Err(e) => {
            assert!(!e.0.is_empty(), "an error names at least one problem");
            assert!(e.0.iter().all(|p| !p.option.is_empty()));
        }
    }
});
