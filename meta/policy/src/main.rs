fn main() {
    policy::main()
}
