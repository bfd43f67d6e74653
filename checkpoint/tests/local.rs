//! The core suite over a local directory, given as a plain path and as a file:// URL.

#[macro_use]
mod common;

mod plain_path {
    core_suite!(crate::common::Backend::dir_path());
}

mod file_url {
    core_suite!(crate::common::Backend::file_url());
}
