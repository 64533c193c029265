// Placeholder while the plugin is written.
fn main() {
    std::process::exit(2)
}
