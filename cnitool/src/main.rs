fn main() {
    std::process::exit(cnitool::cli::main());
}
