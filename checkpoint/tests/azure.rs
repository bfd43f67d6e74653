//! The core suite on Azure Blob Storage (`az://`), against Azurite started by the test (never
//! skipped: a missing Azurite fails the test with how to install it). The store is reached with
//! object_store's emulator settings: `AZURE_STORAGE_USE_EMULATOR=true` and
//! `AZURITE_BLOB_STORAGE_URL`.

mod common;

use checkpoint::emulators::Azurite;

#[test]
fn azurite_core_suite() {
    let server = std::sync::Arc::new(Azurite::start());
    let s = server.clone();
    common::cloud_suite_with_env("azure", server.env(), move |prefix| s.url(prefix));
}
